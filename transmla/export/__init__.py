"""Export targets: a native MLA checkpoint written in the formats other engines load.

deepseek: a stock DeepSeek-V3 folder (transformers, vLLM, SGLang); engines: who loads it.
gguf: a llama.cpp `deepseek2` GGUF written from a DeepSeek-V3 config and tensor stream.
errors: the one refusal every target raises.
"""
