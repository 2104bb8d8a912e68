// transmla-logits: run a GGUF model in llama.cpp on given token ids and write every position's
// logits (float32, row-major [n_tokens, n_vocab]) to a file, so tests can compare llama.cpp with
// our own model. The KV cache is kept in f32 so the comparison is exact up to float rounding.
//
//   transmla-logits MODEL.gguf OUT.bin prefill|decode N_CTX TOKEN [TOKEN ...]
//
// prefill: one batch with all tokens; decode: one llama_decode call per token (the cached path);
// parallel: two sequences of the same tokens, each prompt (all but the last 8 tokens) decoded on its
// own, then the last 8 tokens of both sequences decoded together, one batch of two per step (the
// cache holds both sequences: parallel decode); OUT then holds [2, n_tokens, n_vocab].
// llama.cpp's own log (model hparams, KV cache size) goes to stderr.
//
// Built against ik_llama.cpp (tools/ik_llama_cpp/build.sh, -DIK_LLAMA_CPP) the same tool takes its
// MLA mode, flash attention (0 or 1) and the KV cache type (f32, f16, bf16 or q8_0, or K,V types:
// on the CPU its flash attention takes no f32 cache and without it the V cache must be f16 or bf16)
// after N_CTX (its llama.h names a few calls and
// fields differently):
//
//   transmla-logits MODEL.gguf OUT.bin prefill|decode N_CTX MLA FA KV_TYPE TOKEN [TOKEN ...]
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef IK_LLAMA_CPP
#define MODE_ARGS " MLA FA KV_TYPE"
static const int first_token = 8;
static ggml_type cache_type(const char * name) {  // f32, f16, bf16 or q8_0, up to the end or a comma
    const size_t n = strcspn(name, ",");
    return strncmp(name, "f16", n) == 0 && n == 3 ? GGML_TYPE_F16 : strncmp(name, "bf16", n) == 0 && n == 4 ? GGML_TYPE_BF16
         : strncmp(name, "q8_0", n) == 0 && n == 4 ? GGML_TYPE_Q8_0 : GGML_TYPE_F32;
}
#define llama_model_free llama_free_model
#else
#define MODE_ARGS ""
static const int first_token = 5;
#endif

int main(int argc, char ** argv) {
    const char * mode = argc > 3 ? argv[3] : "";
    const bool prefill = strcmp(mode, "prefill") == 0, parallel = strcmp(mode, "parallel") == 0;
    if (argc < first_token + 1 || (!prefill && !parallel && strcmp(mode, "decode") != 0)) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.bin prefill|decode|parallel N_CTX" MODE_ARGS " TOKEN [TOKEN ...]\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> tokens;
    for (int i = first_token; i < argc; i++) tokens.push_back((llama_token) atoi(argv[i]));
    const int n = (int) tokens.size();

    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
#ifdef IK_LLAMA_CPP
    mparams.mla = atoi(argv[5]);  // ik derives attn_k_b/attn_v_b from attn_kv_b at load for this MLA mode
#endif
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (model == nullptr) { fprintf(stderr, "failed to load %s\n", argv[1]); return 1; }

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t) atoi(argv[4]);  // the KV cache holds this many tokens (>= the tokens given)
    cparams.n_batch = (uint32_t) n;
    cparams.n_ubatch = (uint32_t) n;
    cparams.n_seq_max = parallel ? 2 : 1;
    cparams.n_threads = 1;
    cparams.n_threads_batch = 1;
    cparams.type_k = GGML_TYPE_F32;
    cparams.type_v = GGML_TYPE_F32;
#ifdef IK_LLAMA_CPP
    cparams.mla_attn = atoi(argv[5]);
    cparams.flash_attn = atoi(argv[6]) != 0;
    const char * comma = strchr(argv[7], ',');  // KV_TYPE: one type, or K,V
    cparams.type_k = cache_type(argv[7]);
    cparams.type_v = cache_type(comma ? comma + 1 : argv[7]);
#else
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
#endif
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) { fprintf(stderr, "failed to create a context\n"); return 1; }

    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    // each llama_decode call: (sequence, first token, count); parallel's last steps hold both sequences
    struct call { int seq, first, count; bool both; };
    std::vector<call> calls;
    const int n_prompt = parallel ? n - 8 : 0;
    if (parallel && n_prompt < 1) { fprintf(stderr, "parallel needs more than 8 tokens\n"); return 2; }
    if (prefill) calls.push_back({0, 0, n, false});
    for (int t = 0; t < n && !prefill && !parallel; t++) calls.push_back({0, t, 1, false});
    if (parallel) {
        calls.push_back({0, 0, n_prompt, false});
        calls.push_back({1, 0, n_prompt, false});
        for (int t = n_prompt; t < n; t++) calls.push_back({0, t, 1, true});
    }
    std::vector<float> out((size_t) (parallel ? 2 : 1) * n * n_vocab);
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (const call & c : calls) {
        const int n_seq = c.both ? 2 : 1;
        batch.n_tokens = c.count * n_seq;
        for (int s = 0; s < n_seq; s++) {
            for (int j = 0; j < c.count; j++) {
                const int i = s * c.count + j;
                batch.token[i] = tokens[c.first + j];
                batch.pos[i] = c.first + j;
                batch.n_seq_id[i] = 1;
                batch.seq_id[i][0] = c.both ? s : c.seq;
                batch.logits[i] = 1;
            }
        }
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }
        for (int i = 0; i < batch.n_tokens; i++) {
            const int seq = batch.seq_id[i][0], pos = batch.pos[i];
            memcpy(&out[((size_t) seq * n + pos) * n_vocab], llama_get_logits_ith(ctx, i), sizeof(float) * n_vocab);
        }
    }
    FILE * f = fopen(argv[2], "wb");
    if (f == nullptr || fwrite(out.data(), sizeof(float), out.size(), f) != out.size()) {
        fprintf(stderr, "failed to write %s\n", argv[2]);
        return 1;
    }
    fclose(f);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
