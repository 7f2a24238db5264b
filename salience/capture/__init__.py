"""`salience capture`: a corpus through the serving engine, its residual stream written to shards;
and `salience features top`: where an SAE feature fires most in such a capture.

corpus.py reads documents, sources.py runs them (in-process engine, or a running server over
gRPC), shards.py writes safetensors shards and resumes; run.py ties them with progress.
feature_tops.py reads shards back through an SAE; commands.py holds both commands' CLI.
Format and resume rules: docs/capture.md.
"""
