"""Speed, apart from quality (eval/): what `transmla bench` runs.

decode: one layer's decode step on a GPU (`transmla bench decode`); generate: end-to-end decode
and prefill of a model against its source (`transmla bench generate`); llama_cpp: running the
llama.cpp build (logits, its KV cache, tokenization, perplexity, llama-bench). The machine record
written beside each result is transmla/machine.py.
"""
