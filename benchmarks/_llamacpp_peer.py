"""The llama.cpp side of benchmarks/llamacpp.py. It runs under the Python of a SEPARATE virtual environment
that has llama-cpp-python, gguf and safetensors (never qkv's: llama.cpp is an optional peer, not a
dependency), so this file imports neither torch nor qkv.

    PY write FOLDER OUT_DIR               GGUF files of an fp32 Hugging Face Llama folder:
                                          OUT_DIR/{F32,BF16,Q8_0}.gguf
    PY serve THREADS N_CTX NAME=GGUF ...  load each GGUF once, then answer JSON requests, one per stdin line:
        {"op": "decode", "model": NAME, "prompt": [ids], "new": N}
            -> {"seconds": s, "tokens": [N ids]}   the prompt is evaluated first (not timed), then N greedy
                                                   steps: argmax of the last logits, one-token llama_decode
                                                   (timed)
        {"op": "logits", "model": NAME, "prompt": [ids], "path": P}
            -> the last position's logits saved to P (.npy)

The GGUF is written directly with gguf's GGUFWriter (llama.cpp's convert_hf_to_gguf.py needs torch and a real
tokenizer): architecture "llama", llama.cpp's tensor names, q/k rows permuted from Hugging Face's rotate-half
RoPE layout to the interleaved pairs llama.cpp's "llama" rotates (convert_hf_to_gguf's LlamaModel.permute),
and a placeholder SentencePiece vocabulary (token ids in, token ids out: nothing is tokenized). Norms stay F32
in every file, as the converter keeps them; BF16 and Q8_0 are gguf.quants' round-to-nearest-even and 32-weight
blocks.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

FORMATS = ("F32", "BF16", "Q8_0")

BLOCK_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q or k projection from rotate-half (first half, second half of each head) to interleaved
    pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and parts[-1] == "weight" and ".".join(parts[3:-1]) in BLOCK_NAMES:
        return f"blk.{parts[2]}.{BLOCK_NAMES['.'.join(parts[3:-1])]}.weight"
    raise SystemExit(f"llamacpp peer: error: no GGUF name for {hf_name} (a plain Llama without biases is "
                     "expected)")


def hyper(cfg: dict) -> dict:
    """The config.json fields the GGUF needs; a Llama variant this writer would get wrong is refused."""
    if cfg.get("model_type") != "llama":
        raise SystemExit(f"llamacpp peer: error: model_type {cfg.get('model_type')!r}, expected 'llama'")
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if (rope.get("rope_type", "default") != "default"
        or scaling.get("rope_type", scaling.get("type", "default")) != "default"):
        raise SystemExit("llamacpp peer: error: only default RoPE is written (no rope scaling)")
    n_head = cfg["num_attention_heads"]
    return {"vocab": cfg["vocab_size"], "d": cfg["hidden_size"], "ff": cfg["intermediate_size"],
            "layers": cfg["num_hidden_layers"], "n_head": n_head,
            "n_kv": cfg.get("num_key_value_heads", n_head),
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // n_head,
            "eps": cfg.get("rms_norm_eps", 1e-6),
            "theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            "ctx": cfg.get("max_position_embeddings", 2048)}


def write_gguf(folder: str, out_dir: str) -> None:
    import gguf
    from safetensors.numpy import load_file

    h = hyper(json.loads((Path(folder) / "config.json").read_text()))
    tensors = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):  # numpy has no bf16: the folder is fp32
        tensors.update(load_file(shard))
    files = {"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
             "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    for fmt, ftype in files.items():
        w = gguf.GGUFWriter(str(Path(out_dir) / f"{fmt}.gguf"), "llama")
        w.add_context_length(h["ctx"])
        w.add_embedding_length(h["d"])
        w.add_block_count(h["layers"])
        w.add_feed_forward_length(h["ff"])
        w.add_head_count(h["n_head"])
        w.add_head_count_kv(h["n_kv"])
        w.add_key_length(h["head_dim"])
        w.add_value_length(h["head_dim"])
        w.add_rope_dimension_count(h["head_dim"])
        w.add_rope_freq_base(float(h["theta"]))
        w.add_layer_norm_rms_eps(float(h["eps"]))
        w.add_vocab_size(h["vocab"])
        w.add_file_type(ftype)
        add_vocab(w, h["vocab"], gguf)
        for name, t in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            t = t.astype(np.float32)
            if name.endswith("q_proj.weight"):
                t = permute(t, h["n_head"])
            elif name.endswith("k_proj.weight"):
                t = permute(t, h["n_kv"])
            qtype = gguf.GGMLQuantizationType[fmt] if t.ndim == 2 else gguf.GGMLQuantizationType.F32
            data = t if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(t, qtype)
            w.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def add_vocab(w, n: int, gguf) -> None:
    """A SentencePiece-type vocabulary of placeholder pieces: llama.cpp needs one to load, the benchmark feeds
    ids."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<t{i}>" for i in range(3, n)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL,
             gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (n - 3)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def serve(threads: int, n_ctx: int, models: list[str]) -> None:
    import llama_cpp

    llms = {}
    for spec in models:
        name, path = spec.split("=", 1)
        llms[name] = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                     n_threads_batch=threads, verbose=False)
    print(json.dumps({"ready": True, "llama_cpp_python": llama_cpp.__version__,
                      "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}),
          flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        llm = llms[req["model"]]
        llm.reset()
        # the prefill (not timed), one token at a time: llama.cpp 0.3.36's batched Q8_0 product segfaults on
        # an AVX-512 + AMX CPU (a 32-token prompt of the 135M shape); one-row products are the decoding path
        for token in req["prompt"]:
            llm.eval([token])
        if req["op"] == "logits":
            np.save(req["path"], last_logits(llama_cpp, llm).copy())
            print(json.dumps({"path": req["path"]}), flush=True)
            continue
        tokens = []
        t0 = time.perf_counter()
        for _ in range(req["new"]):
            tokens.append(int(last_logits(llama_cpp, llm).argmax()))
            llm.eval([tokens[-1]])
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


def last_logits(llama_cpp, llm) -> np.ndarray:
    """A view of the logits of the last token llm.eval saw (Llama.eval keeps them only with logits_all)."""
    # llama-cpp-python 0.3.x keeps the context pointer in llm._ctx.ctx (llm.ctx is no longer it: a segfault)
    ctx = llm._ctx.ctx if hasattr(llm, "_ctx") else llm.ctx
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(llm.n_vocab(),))


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write_gguf(*sys.argv[2:4])
    elif sys.argv[1] == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    else:
        raise SystemExit(f"llamacpp peer: error: unknown command {sys.argv[1]!r} (write or serve)")
