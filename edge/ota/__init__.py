"""Fleet OTA: signed bundles of models, engines and config; atomic install; health check;
automatic rollback. Needs no GPU, TensorRT or llama.cpp: it moves and verifies files."""
