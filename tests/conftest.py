"""Shared fixtures: tiny random HF checkpoints of each supported architecture, and the
converted default model.

`make_tiny_model(arch, tokenizer=False, **config_overrides) -> Path` saves (once per
argument set and session) a seeded random model with transformers' own class, so tests
can compare our model with HF's on the same weights. The weights are scaled up from
HF's init and norms/biases randomised, so a wrongly loaded tensor changes the logits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Plain `pytest` from a checkout works without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collections.abc import Callable, Iterator  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA the Triton kernels run in the interpreter on CPU tensors. runner/__init__.py sets
# this for the package; set here too, since test modules import Triton before the package
# (pytest.importorskip), and Triton decides at its import whether tl.sum is interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "initializer_range": 0.1,
}
# Per architecture: the HF class name and what differs from the base. Llama keeps an
# untied head, Qwen2 ties it (and has q/k/v bias), Qwen3 has head_dim != hidden / heads,
# Phi-3 stores q/k/v and gate/up fused, Granite scales embeddings, attention, residuals and
# logits, SmolLM3 leaves RoPE out of some layers, OLMo 2 norms each branch on its way out,
# Gemma 3 norms both ways, scales attention by query_pre_attn_scalar, gates with GeLU and mixes
# local layers (a sliding window of 16 tokens, their own RoPE base) with global ones; Gemma 2
# has no q/k norms and one RoPE base, but caps its attention scores and its logits.
TINY_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {"tie_word_embeddings": False, "rope_theta": 10000.0}),
    "mistral": ("MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen3": (
        "Qwen3ForCausalLM",
        {"tie_word_embeddings": False, "head_dim": 32, "rope_theta": 1e6},
    ),
    "phi3": ("Phi3ForCausalLM", {"tie_word_embeddings": False, "sliding_window": None}),
    "smollm3": ("SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),  # RoPE every other layer
    "olmo2": ("Olmo2ForCausalLM", {"tie_word_embeddings": False}),
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_logit_softcapping": 5.0,  # small enough to bite on these scores
            "final_logit_softcapping": 8.0,
        },
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        },
    ),
    "granite": (
        "GraniteForCausalLM",
        {
            "tie_word_embeddings": True,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.1,
            "logits_scaling": 2.0,
        },
    ),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_model(arch: str, path: Path, tokenizer: bool = False, **overrides: Any) -> Path:
    """Save a seeded random `arch` model (HF format) into `path`; returns `path`."""
    import transformers

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; have {', '.join(TINY_ARCHS)}")
    cls_name, arch_cfg = TINY_ARCHS[arch]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**{**TINY_BASE, **arch_cfg, **overrides})
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return path


def load_hf_reference(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model at `path` in eval mode, as the reference our engine must equal.

    A model that caps its attention scores (Gemma 2's `attn_logit_softcapping`) gets
    transformers' eager attention, the one implementation that applies the cap: some
    releases (5.17 among them) default it to SDPA, which drops the cap without a word."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    capped = getattr(config.get_text_config(), "attn_logit_softcapping", None) is not None
    options = {"attn_implementation": "eager"} if capped else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **options).eval()


def tiny_tokenizer() -> Any:
    """Byte-level tokenizer: ids 0-2 are <unk> <s> </s>, ids 3..258 the 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = 3 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: make_tiny_model(arch, tokenizer=False, **config_overrides) -> folder.

    Cached per session and argument set, so asking twice costs nothing."""
    made: dict[str, Path] = {}

    def make(arch: str, tokenizer: bool = False, **overrides: Any) -> Path:
        key = repr((arch, tokenizer, sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny_{arch}")
            made[key] = build_tiny_model(arch, folder, tokenizer=tokenizer, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("qwen3")


@pytest.fixture(scope="session")
def tiny_phi3_dir(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("phi3")


@pytest.fixture(scope="session")
def tiny_granite_dir(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("granite")


@pytest.fixture(scope="session")
def tiny_smollm3_dir(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("smollm3")


@pytest.fixture(scope="session")
def tiny_olmo2_dir(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("olmo2")


@pytest.fixture(scope="session")
def tiny_gemma2_dir(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("gemma3")


@pytest.fixture(scope="session")
def tiny_mistral_window_dir(make_tiny_model: Callable[..., Path]) -> Path:
    """Mistral attending to its last 20 tokens in every layer."""
    return make_tiny_model("mistral", sliding_window=20)


@pytest.fixture(scope="session")
def tiny_qwen2_window_dir(make_tiny_model: Callable[..., Path]) -> Path:
    """Qwen2 with use_sliding_window: its second layer attends to its last 12 tokens."""
    return make_tiny_model("qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=1)


@pytest.fixture(scope="session")
def tiny_llama_tok_dir(make_tiny_model: Callable[..., Path]) -> Path:
    """Tiny Llama with a byte-level tokenizer and a chat template (eos '</s>' = 2)."""
    return make_tiny_model("llama", tokenizer=True)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model as a HF folder (converted into the loader cache the
    first time, ~25 s; later sessions reuse it)."""
    from runner.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for the test session: on a busy 2-core machine torch's default of
    two spinning OpenMP threads makes each tiny matmul ~100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


from tests.redis_server import redis_server  # noqa: E402, F401  (a fixture: a real Redis server)
