"""Finding, fetching and loading model files (GGUF, Hugging Face folders) and their tokenizers."""
