"""edge's benchmarks, one module each, run as `scripts/bench NAME [OPTIONS]` (`python -m
benchmarks.NAME` with scripts/ on PYTHONPATH, after the setup each needs; docs/performance.md says
what each measures and the latest numbers):

- `coldstart`: cold start of edge vs llama-cpp-python's server and llama.cpp's llama-server;
- `steady`: steady-state requests against the same two peers; `profile_steady`: where a steady
  request's time goes inside `edge serve` (py-spy);
- `prefix`: a long prefix kept warm, with `turns` (prefixes that take turns, chats re-sent);
- `concurrency`: many clients at once against `llama-server -np C`;
- `load`: 8 clients across reloads and a restart; `paths`: the four start paths under 8 clients;
- `ota`: update bytes, store disk use, a reload activation under load;
- `engines`: a prebuilt engine vs building at start; `batching`: KServe requests batched or not;
- `flood`: a normal client's wait under an idle-connection flood;
- `cache_bound`: the prompt cache's bound on logprobs (a measurement, not a timing);
- `grammar_limits`: a grammar's stack depth and compile and per-token cost in llama.cpp;
- `warmup_noise`: the spread of a warm-up candidate's first-minus-repeat on this machine.

`common` holds what they share: the model, novel prompts, edge and its peers started the same
way, the result written to .bench/. What they share with the tests (the PID-1 stand-in, client
load, the tiny models) is the harness (scripts/harness), never the test kit.
"""
