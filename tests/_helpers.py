"""Test helpers: tiny random models (HF directories and GGUF files) and reference checks."""

from __future__ import annotations

import socket
import threading
import time
import warnings

import numpy as np
import torch

TINY_VOCAB = 320
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paging splits the KV cache into blocks.",
    "Héllo wörld, café crème brûlée, naïve façade; ¿qué tal? Grüße aus Köln.",
    "日本語のテキストと絵文字 🙂🚀 mixed with English words and numbers 12345.",
    "Once upon a time there was a little engine that served many users at once.",
]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def make_sequence(prompt: list[int], params=None, eos: int = 2, request_id: str = "r",
                  cache_salt: str | None = None):
    """A Request with one Sequence, without an engine (for scheduler and sampler tests)."""
    from pagedserve.core.block_pool import root_hash
    from pagedserve.outputs import RequestMetrics
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.sequence import Request, Sequence

    params = params or SamplingParams(max_tokens=8)
    request = Request(request_id, None, list(prompt), params, params.max_tokens or 16,
                      frozenset({eos}), RequestMetrics(0.0), root_hash=root_hash(cache_salt))
    seq = Sequence(0, request, 0, list(prompt))
    request.seqs.append(seq)
    return seq


def shared_prefix_workload(n: int = 20, min_tokens: int = 40):
    """``n`` prompts of a 45-token shared prefix (11 full blocks of 4) plus a distinct tail,
    with greedy outputs of ``min_tokens`` to ``min_tokens + 30`` tokens (ignore_eos)."""
    from pagedserve import SamplingParams

    prefix = [(31 * j + 7) % 300 + 3 for j in range(45)]
    prompts = [{"prompt_token_ids": prefix + [(13 * i + 5 * j) % 300 + 3
                                              for j in range(3 + i % 7)]} for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=min_tokens + (13 * i) % 31,
                             ignore_eos=True) for i in range(n)]
    return prompts, params


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained on a small corpus (multi-byte characters span
    several tokens), with <unk>=0, <s>=1, </s>=2 and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(path, arch: str = "llama", **overrides) -> str:
    """A small random transformers model saved as an HF directory; returns the path."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    torch.manual_seed(1234)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "gemma3":  # 5 sliding-window layers of 8 positions, then a global one
        common.update(num_hidden_layers=6, sliding_window=8, tie_word_embeddings=True,
                      **overrides)
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common))
    elif arch == "qwen3":  # head_dim apart from hidden / heads, as in the real Qwen 3
        common.setdefault("head_dim", 32)
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Random init gives near-uniform logits; sharpen them so greedy choices are not ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(path))
    return str(path)


def save_base_model(path) -> str:
    """A tiny Gemma 3 whose tokenizer has no chat template (a base model, as gemma3-270m)."""
    import json
    from pathlib import Path

    out = save_tiny_model(path, "gemma3")
    for f in Path(out).glob("chat_template*"):
        f.unlink()
    config = Path(out) / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items()
                                  if k != "chat_template"}))
    return out


def load_hf(path: str, gguf_file: str | None = None):
    """The transformers reference model (fp32, eval, EOS never stops generation)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers greedy ``generate``, one prompt at a time."""
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        out.append(ids[0, len(p):].tolist())
    return out


def assert_greedy_match(ours: list[int], ref: list[int], prompt: list[int], ref_logits,
                        label: str, tie: float = 1e-4) -> bool:
    """Token-for-token equality of greedy outputs. A mismatch passes only at a genuine
    near-tie: the reference's logits for its own token and ours differ by less than ``tie``
    (1e-4 for float32 models) at that position (then the test warns, and the rest is not
    compared since the sequences diverge). ``ref_logits(ids) -> [vocab]`` gives the
    reference's next-token logits. Returns True when the outputs are identical."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            logits = ref_logits(prompt + ref[:i]).float()
            gap = (logits[b] - logits[a]).item()
            assert gap < tie, (
                f"{label}: token {i} differs (ours {a}, reference {b}) and the reference "
                f"prefers its token by {gap:.3g}, not a near-tie\nours {ours}\nref  {ref}")
            warnings.warn(f"{label}: near-tie at token {i} (logit gap {gap:.2g} < {tie:g}); "
                          "accepted, rest not compared", stacklevel=2)
            return False
    assert len(ours) == len(ref), f"{label}: {len(ours)} tokens vs {len(ref)}"
    return True


def hf_logits_fn(model):
    def fn(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1]
    return fn


_GGUF_LAYER = [("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"),
               ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
               ("self_attn.o_proj", "attn_output"), ("post_attention_layernorm", "ffn_norm"),
               ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
               ("mlp.down_proj", "ffn_down")]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter layout for attn_q / attn_k (interleaved rotary pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_quant(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random but valid Q4_K / Q6_K blocks: random quants, small finite fp16 scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, nbytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:  # d, dmin (fp16) lead the block
        data[..., 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        data[..., 2:4] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)
    else:  # Q6_K: d (fp16) ends the block
        data[..., -2:] = np.frombuffer(np.float16(0.0004).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def write_llama_gguf(hf_dir: str, path: str, qtype_name: str, arch: str = "llama") -> str:
    """Convert a tiny HF model to a GGUF file of architecture ``arch`` (llama, qwen2, qwen3)
    the way llama.cpp does (q/k permuted for llama), with the 2-D weights in
    ``qtype_name``. K-quants get random valid blocks (gguf-py cannot quantize them), so both
    readers dequantize the same bytes."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from transformers import AutoModelForCausalLM

    qtype = T[qtype_name]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not c.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(c.num_hidden_layers):
        for hf_name, g_name in _GGUF_LAYER:
            names[f"model.layers.{i}.{hf_name}.weight"] = f"blk.{i}.{g_name}.weight"
        for x in "qkv" if arch == "qwen2" else "":
            names[f"model.layers.{i}.self_attn.{x}_proj.bias"] = f"blk.{i}.attn_{x}.bias"
        for x in "qk" if arch == "qwen3" else "":
            names[f"model.layers.{i}.self_attn.{x}_norm.weight"] = f"blk.{i}.attn_{x}_norm.weight"
    rng = np.random.default_rng(0)
    for hf_name, g_name in names.items():
        x = sd[hf_name]
        if arch == "llama" and ".attn_q." in g_name:
            x = _permute(x, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in g_name:
            x = _permute(x, c.num_key_value_heads)
        if x.ndim == 1 or qtype == T.F32:
            w.add_tensor(g_name, np.ascontiguousarray(x, dtype=np.float32))
        elif qtype in (T.Q4_K, T.Q6_K):
            w.add_tensor(g_name, _random_k_quant(*x.shape, qtype, rng), raw_dtype=qtype)
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), qtype)
            w.add_tensor(g_name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MODEL = "tiny"  # the served model name of LiveServer


def pace(engine, seconds: float):
    """Make every step of ``engine`` take at least ``seconds`` longer (a slow model, so that
    a stream lasts long enough to watch); returns the engine."""
    step = engine.step

    def paced():
        time.sleep(seconds)
        return step()

    engine.step = paced
    return engine


class LiveServer:
    """A real uvicorn server on 127.0.0.1 (a free port) in a thread, serving ``engine``."""

    def __init__(self, engine, **app_kwargs):
        import uvicorn

        from pagedserve.server import build_app

        self.engine = engine
        self.app = build_app(engine, MODEL, **app_kwargs)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"),
                             max_retries=0, timeout=kwargs.pop("timeout", 60), **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive()

    def idle(self, timeout: float = 2.0) -> float:
        """Seconds until no request runs and no block is in use (AssertionError after
        ``timeout``)."""
        t0 = time.time()
        while True:
            sched = self.engine.scheduler
            busy = sched.running or sched.waiting or sched.swapped
            used = self.engine.block_manager.pool.num_used_blocks
            if not busy and used == 0:
                return time.time() - t0
            assert time.time() - t0 < timeout, f"{len(sched.running)} running, {used} blocks used"
            time.sleep(0.01)
