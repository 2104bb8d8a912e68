"""Export targets: a native MLA checkpoint written in the formats other engines load.

gguf: a llama.cpp `deepseek2` GGUF written from a DeepSeek-V3 config and tensor stream.
"""
