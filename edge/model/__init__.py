"""The llama.cpp model and its state: the file before llama.cpp, the native API, generation, the prompt cache and prefix states."""
