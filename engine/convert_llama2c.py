"""Convert a llama2.c checkpoint (``model.bin`` + ``tokenizer.bin``) into a Hugging Face Llama checkpoint directory.

Weights: the legacy format (7 int32 header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size (negative =
separate classifier), seq_len; then fp32 tensors) and version 1 (``ak42`` magic, 256-byte header). llama2.c rotates
interleaved pairs, transformers rotates halves, so q/k rows are permuted the way transformers' own Llama converter
does. Tokenizer: llama2.c's (score, bytes) list becomes a SentencePiece-style byte-fallback BPE (merges ordered by
score) with the Llama normalizer and decoder. llama2.c's ``run`` stops when it samples BOS (it separates stories),
so generation_config lists BOS next to EOS. Both files must end where their last tensor or token does. The output is
written into a temporary sibling of the output directory that becomes it only once complete; an output directory that
already holds a checkpoint is refused.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from ember.engine.checkpoint_writer import holds_checkpoint, save_safetensors, staged

_MAGIC_V1 = 0x616B3432


def _read_weights(bin_path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(hyperparameters, tensors by llama2.c name); ValueError naming ``bin_path`` when it is not a llama2.c
    checkpoint or is shorter or longer than its header says."""
    raw = bin_path.read_bytes()
    if len(raw) < 28:
        raise ValueError(f"{bin_path}: not a llama2.c model.bin (only {len(raw)} bytes, shorter than its header)")
    (magic,) = struct.unpack_from("<I", raw, 0)
    if magic == _MAGIC_V1:
        version, = struct.unpack_from("<i", raw, 4)
        if version != 1:
            raise ValueError(f"{bin_path}: llama2.c export version {version} is not supported (0 or 1)")
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack_from("<7i", raw, 8)
        shared = bool(raw[8 + 28])
        offset = 256
    else:
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack_from("<7i", raw, 0)
        shared = vocab > 0
        vocab = abs(vocab)
        offset = 28
    hp = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, vocab_size=vocab,
              seq_len=seq_len, shared_classifier=shared)
    if min(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len) <= 0 or dim % n_heads or n_heads % n_kv or (
            dim // n_heads) % 2:
        shapes = ", ".join(f"{k}={v}" for k, v in hp.items() if k != "shared_classifier")
        raise ValueError(f"{bin_path}: not a llama2.c model.bin (its header reads {shapes})")
    head = dim // n_heads
    kv_dim = n_kv * head
    if len(raw) < offset:
        raise ValueError(f"{bin_path}: not a llama2.c model.bin (only {len(raw)} bytes, shorter than its header)")
    data = np.frombuffer(raw, dtype="<f4", offset=offset, count=(len(raw) - offset) // 4)
    pos = 0

    def take(*shape: int) -> torch.Tensor:
        nonlocal pos
        n = int(np.prod(shape))
        if pos + n > data.size:
            raise ValueError(f"{bin_path}: file too short for the shapes its header gives ({hp}); truncated?")
        t = torch.from_numpy(data[pos:pos + n].copy()).reshape(shape)
        pos += n
        return t

    w: dict[str, torch.Tensor] = {}
    if magic == _MAGIC_V1:
        w["att_norm"] = take(n_layers, dim)
        w["ffn_norm"] = take(n_layers, dim)
        w["norm"] = take(dim)
        w["emb"] = take(vocab, dim)
    else:
        w["emb"] = take(vocab, dim)
        w["att_norm"] = take(n_layers, dim)
    w["wq"] = take(n_layers, n_heads * head, dim)
    w["wk"] = take(n_layers, kv_dim, dim)
    w["wv"] = take(n_layers, kv_dim, dim)
    w["wo"] = take(n_layers, dim, n_heads * head)
    if magic != _MAGIC_V1:
        w["ffn_norm"] = take(n_layers, dim)
    w["w1"] = take(n_layers, hidden, dim)
    w["w2"] = take(n_layers, dim, hidden)
    w["w3"] = take(n_layers, hidden, dim)
    if magic != _MAGIC_V1:
        w["norm"] = take(dim)
        take(seq_len, head // 2)  # freq_cis_real (unused: RoPE is recomputed)
        take(seq_len, head // 2)  # freq_cis_imag
    if not shared:
        w["cls"] = take(vocab, dim)
    extra = len(raw) - offset - 4 * pos
    if extra:
        raise ValueError(f"{bin_path}: {extra} bytes after the tensors its header gives ({hp}); not a llama2.c "
                         "model.bin of these shapes")
    return hp, w


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair RoPE rows -> rotate-half rows (transformers' Llama converter)."""
    d1, d2 = w.shape
    return w.view(n_heads, d1 // n_heads // 2, 2, d2).transpose(1, 2).reshape(d1, d2)


def _hf_weights(hp: dict, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": w["emb"], "model.norm.weight": w["norm"]}
    for i in range(hp["n_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = w["att_norm"][i]
        out[p + "post_attention_layernorm.weight"] = w["ffn_norm"][i]
        out[p + "self_attn.q_proj.weight"] = _permute(w["wq"][i], hp["n_heads"])
        out[p + "self_attn.k_proj.weight"] = _permute(w["wk"][i], hp["n_kv_heads"])
        out[p + "self_attn.v_proj.weight"] = w["wv"][i]
        out[p + "self_attn.o_proj.weight"] = w["wo"][i]
        out[p + "mlp.gate_proj.weight"] = w["w1"][i]
        out[p + "mlp.down_proj.weight"] = w["w2"][i]
        out[p + "mlp.up_proj.weight"] = w["w3"][i]
    if "cls" in w:
        out["lm_head.weight"] = w["cls"]
    return {k: v.contiguous() for k, v in out.items()}


def read_llama2c_tokenizer(path: Path, vocab_size: int) -> list[tuple[bytes, float]]:
    """(piece bytes, score) per token id; ValueError naming ``path`` unless it holds exactly ``vocab_size`` tokens."""
    raw = path.read_bytes()
    pos = 4  # max_token_length
    pieces = []
    for i in range(vocab_size):
        if pos + 8 > len(raw):
            raise ValueError(f"{path}: holds fewer than {vocab_size} tokens (stopped at {i})")
        score, n = struct.unpack_from("<fi", raw, pos)
        pos += 8
        if n < 0 or pos + n > len(raw):
            raise ValueError(f"{path}: not a llama2.c tokenizer.bin (token {i} claims {n} bytes)")
        pieces.append((raw[pos:pos + n], score))
        pos += n
    if pos != len(raw):
        raise ValueError(f"{path}: {len(raw) - pos} bytes after its first {vocab_size} tokens (model.bin's vocab_size):"
                         " a tokenizer for a larger vocabulary, or not a llama2.c tokenizer.bin")
    return pieces


def build_tokenizer(pieces: list[tuple[bytes, float]]) -> Tokenizer:
    """A byte-fallback BPE equivalent to the llama2.c/SentencePiece vocabulary."""
    vocab: dict[str, int] = {}
    scores: dict[str, float] = {}
    for i, (b, score) in enumerate(pieces):
        if i == 0:
            s = "<unk>"
        elif i == 1:
            s = "<s>"
        elif i == 2:
            s = "</s>"
        else:
            s = b.decode("utf-8", errors="replace").replace(" ", "\u2581")
        if s in vocab:  # keep the first id for a duplicate piece
            continue
        vocab[s] = i
        scores[s] = score
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        if vocab[piece] < 3 or (piece.startswith("<0x") and piece.endswith(">")):
            continue
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: m[2], reverse=True)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tok


def convert(bin_path: str | Path, tokenizer_bin_path: str | Path, out_dir: str | Path) -> Path:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files into ``out_dir`` (must not
    hold a checkpoint; nothing written there unless all of them are)."""
    bin_path, tokenizer_bin_path, out = Path(bin_path), Path(tokenizer_bin_path), Path(out_dir)
    hp, w = _read_weights(bin_path)
    pieces = read_llama2c_tokenizer(tokenizer_bin_path, hp["vocab_size"])
    if holds_checkpoint(out):
        raise ValueError(f"{out}: already holds a checkpoint")
    with staged(out) as tmp:
        _write(hp, w, pieces, tmp, out)
    return out


def _write(hp: dict, w: dict[str, torch.Tensor], pieces: list[tuple[bytes, float]], out: Path, shown: Path) -> None:
    """The checkpoint's files in directory ``out``; a weight file that cannot be written is named as in ``shown``."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hp["dim"], "intermediate_size": hp["hidden_dim"], "num_hidden_layers": hp["n_layers"],
        "num_attention_heads": hp["n_heads"], "num_key_value_heads": hp["n_kv_heads"],
        "head_dim": hp["dim"] // hp["n_heads"], "vocab_size": hp["vocab_size"],
        "max_position_embeddings": hp["seq_len"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": hp["shared_classifier"], "attention_bias": False,
        "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": [2, 1]}, indent=2) + "\n")
    save_safetensors(_hf_weights(hp, w), out / "model.safetensors", shown / "model.safetensors")
    tok = build_tokenizer(pieces)
    (out / "tokenizer.json").write_text(tok.to_str() + "\n")
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
               "clean_up_tokenization_spaces": False, "model_max_length": hp["seq_len"]}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ember convert-llama2c",
                                 description="Convert a llama2.c model.bin + tokenizer.bin to a Hugging Face Llama dir")
    ap.add_argument("model_bin")
    ap.add_argument("tokenizer_bin")
    ap.add_argument("out_dir")
    args = ap.parse_args(argv)
    try:
        path = convert(args.model_bin, args.tokenizer_bin, args.out_dir)
    except OSError as e:
        print(f"ember convert-llama2c: error: {e.filename}: {e.strerror}" if e.filename and e.strerror else
              f"ember convert-llama2c: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"ember convert-llama2c: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
