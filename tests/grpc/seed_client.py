"""A client built only from the seed's proto text: `python seed_client.py STUB_DIR TARGET PROMPT_JSON`.

Run in its own process so nothing of the project's package or stubs is loaded; prints JSON.
"""

import json
import sys

sys.path.insert(0, sys.argv[1])
import grpc
import salience_pb2 as pb
import salience_pb2_grpc

target, prompt = sys.argv[2], json.loads(sys.argv[3])
rpc = salience_pb2_grpc.SalienceStub(grpc.insecure_channel(target))
opened = rpc.OpenSession(pb.OpenSessionRequest(model="tiny"))
request = pb.GenerateRequest(
    session_id=opened.session_id,
    append_tokens=prompt,
    offset=0,
    max_tokens=4,
    top_k=1,
    logprobs_ranges=[pb.PositionRange(start=len(prompt) - 1, end=len(prompt) + 4)],
    logprob_top_k=2,
    readout_ranges=[pb.PositionRange(start=len(prompt) - 1, end=len(prompt) + 1)],
)
events = list(rpc.Generate(request))
tokens = [e.token for e in events if e.WhichOneof("event") == "token"]
done = events[-1].done
fork = rpc.ForkSession(pb.ForkSessionRequest(session_id=opened.session_id, at_position=len(prompt)))
forked = rpc.DumpSession(pb.DumpSessionRequest(session_id=fork.session_id)).tokens
dump = rpc.DumpSession(pb.DumpSessionRequest(session_id=opened.session_id)).tokens
rpc.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))
manifest = rpc.GetReadoutManifest(pb.GetReadoutManifestRequest())
print(
    json.dumps(
        {
            "max_model_len": opened.max_model_len,
            "tokens": [
                {
                    "id": t.id,
                    "position": t.position,
                    "is_prefill": t.is_prefill,
                    "readout": list(t.readout),
                    "logprob": t.sampled_logprob if t.has_sampled_logprob else None,
                    "alternatives": [a.id for a in t.logprobs],
                }
                for t in tokens
            ],
            "done": [
                done.prompt_tokens,
                done.completion_tokens,
                done.total_tokens,
                pb.GenerateDone.FinishReason.Name(done.finish_reason),
            ],
            "dump": list(dump),
            "forked": list(forked),
            "concepts": list(manifest.concepts),
        }
    )
)
