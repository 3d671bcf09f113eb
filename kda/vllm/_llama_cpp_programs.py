"""The two programs :mod:`kda.vllm.llama_cpp` runs as children: the converter's wrapper
(:data:`CONVERT_PY`, Python, nothing of kda imported) and the greedy runner (:data:`GREEDY_C`, C
against ``libllama``, compiled by :func:`kda.vllm.llama_cpp.build`). Source text only; no imports."""

__all__ = ["CONVERT_PY", "GREEDY_C"]

#: the converter's process (``python -c CONVERT_PY SPEC_JSON CONVERTER_ARGS...``; nothing of kda
#: imported): registers the pre-tokenizer answers (``pre``: hash -> name, checked on the tokens of
#: ``text``) and the architecture ``aliases`` of ``SPEC_JSON`` in the converter's modules (and, with
#: ``json_config``, makes its ``AutoConfig`` load fail so that it reads ``config.json`` as written),
#: then runs ``convert_hf_to_gguf.py`` as ``__main__``
CONVERT_PY = r"""
import hashlib, json, runpy, sys

spec = json.loads(sys.argv[1])
src = spec["source"]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion
from conversion import base

original = base.TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    digest = hashlib.sha256(str(tokenizer.encode(spec["text"])).encode()).hexdigest()
    if digest in spec["pre"]:
        return spec["pre"][digest]
    return original(self, tokenizer)


base.TextModel.get_vocab_base_pre = get_vocab_base_pre
if spec.get("json_config"):  # config.json as written: AutoConfig fails, the converter reads the file


    class NoAutoConfig:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise ValueError("config.json read as written (kda.vllm.llama_cpp.convert(json_config=True))")


    base.AutoConfig = NoAutoConfig  # the converter's name only; transformers' AutoTokenizer keeps its own
for alias, target in spec["aliases"].items():
    if target not in conversion.TEXT_MODEL_MAP:
        sys.exit(f"aliases: {target!r} is not an architecture of the converter")
    conversion.TEXT_MODEL_MAP[alias] = conversion.TEXT_MODEL_MAP[target]
    __import__("conversion." + conversion.TEXT_MODEL_MAP[target])
    classes = base.ModelBase._model_classes[base.ModelType.TEXT]
    classes[alias] = classes[target]
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


#: ``kda-llama-greedy MODEL THREADS N_CTX KV_F32 FLASH``; stdin: a line a prompt, ``N_NEW id id ...``;
#: stdout: for each, ``tokens t1 t2 ...`` and ``margins m1 m2 ...`` (top logit minus the runner-up's);
#: at the end ``perf LOAD_MS PROMPT_MS EVAL_MS N_PROMPT N_EVAL`` (llama.cpp's own counters, all prompts)
GREEDY_C = r"""
#include "llama.h"
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void quiet(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static bool no_progress(float progress, void * user) { (void) progress; (void) user; return true; }

static int fail(const char * what) { fprintf(stderr, "kda-llama-greedy: %s\n", what); return 1; }

int main(int argc, char ** argv) {
    if (argc != 6) return fail("usage: MODEL THREADS N_CTX KV_F32 FLASH; prompts on stdin");
    const int threads = atoi(argv[2]), n_ctx = atoi(argv[3]);
    const int kv_f32 = atoi(argv[4]), flash = atoi(argv[5]);
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.progress_callback = no_progress;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return fail("cannot load the model");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx; cp.n_batch = n_ctx; cp.n_ubatch = n_ctx < 512 ? n_ctx : 512; cp.n_seq_max = 1;
    cp.n_threads = threads; cp.n_threads_batch = threads; cp.no_perf = false;
    cp.type_k = kv_f32 ? GGML_TYPE_F32 : GGML_TYPE_F16;
    cp.type_v = cp.type_k;
    cp.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return fail("cannot create the context");
    int cap = n_ctx + 1;
    llama_token * ids = malloc(sizeof(llama_token) * cap);
    int n_new;
    while (scanf("%d", &n_new) == 1) {
        int n = 0, c;
        for (;;) {
            while ((c = getchar()) == ' ') {}
            if (c == '\n' || c == EOF) break;
            ungetc(c, stdin);
            if (n >= cap || scanf("%d", &ids[n]) != 1) return fail("bad prompt line or prompt too long");
            n++;
        }
        if (n == 0 || n + n_new > n_ctx) return fail("empty prompt or longer than N_CTX");
        llama_memory_clear(llama_get_memory(ctx), true);
        llama_token * out = malloc(sizeof(llama_token) * n_new);
        float * margin = malloc(sizeof(float) * n_new);
        struct llama_batch batch = llama_batch_get_one(ids, n);
        for (int step = 0; step < n_new; step++) {
            if (llama_decode(ctx, batch) != 0) return fail("llama_decode failed");
            const float * logits = llama_get_logits_ith(ctx, -1);
            int best = 0;
            for (int v = 1; v < n_vocab; v++) if (logits[v] > logits[best]) best = v;
            float second = -3.4e38f;
            for (int v = 0; v < n_vocab; v++) if (v != best && logits[v] > second) second = logits[v];
            out[step] = best;
            margin[step] = logits[best] - second;
            batch = llama_batch_get_one(&out[step], 1);
        }
        printf("tokens");
        for (int i = 0; i < n_new; i++) printf(" %d", out[i]);
        printf("\nmargins");
        for (int i = 0; i < n_new; i++) printf(" %.6g", margin[i]);
        printf("\n");
        fflush(stdout);
        free(out); free(margin);
    }
    struct llama_perf_context_data perf = llama_perf_context(ctx);
    printf("perf %.3f %.3f %.3f %d %d\n", perf.t_load_ms, perf.t_p_eval_ms, perf.t_eval_ms,
           perf.n_p_eval, perf.n_eval);
    free(ids);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
"""
