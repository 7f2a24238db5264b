"""`salience capture`: a corpus through the serving engine, its residual stream written to shards.

corpus.py reads documents, sources.py runs them (in-process engine, or a running server over
gRPC), shards.py writes safetensors shards and resumes; run.py ties them with progress.
Format and resume rules: docs/capture.md.
"""
