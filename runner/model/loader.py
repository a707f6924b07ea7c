"""Model loading: HF folders (config.json + safetensors), GGUF files, the embedded default.

A GGUF file is converted once (transformers dequantizes it) into an HF folder in the
cache (runner/model/gguf.py); every load then reads config.json with AutoConfig and the
safetensors directly into our CausalLM, never instantiating transformers' model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import xxhash
from torch.overrides import TorchFunctionMode

from runner.model.architectures import resolve_architecture, text_config
from runner.model.decoder import CausalLM
from runner.model.gguf import convert_gguf, default_gguf_path
from runner.model.hub import looks_like_hub_id, resolve_hub_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class LoadedModel(NamedTuple):
    model: CausalLM
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None when the folder has none
    fingerprint: str  # stable id of the weights (prefix-cache namespace)
    path: Path  # the HF folder the weights were read from


def load_model(
    model: str | Path | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    max_positions: int | None = None,
) -> LoadedModel:
    """Load `model` (None = embedded default, a HF folder, or a .gguf file) onto `device`.

    dtype defaults to float32 on CPU and bfloat16 on CUDA. max_positions: the positions the
    RoPE tables hold (the engine's max_model_len), at most the model's; None: the model's.
    Raises ValueError naming the file for a missing path, missing config/weights, unknown
    architecture or corrupt files.
    """
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    folder = resolve_model_dir(model)
    config = read_config(folder)
    files = weight_files(folder)
    with SafetensorsWeights(files) as weights:  # the files are unmapped once copied
        with SkipMetaInit(), torch.device("meta"):
            net = CausalLM(config)  # validates the architecture before any weight is read
        net = net.to(dtype=torch_dtype).to_empty(device=dev)
        net.init_rope_cache(max_positions)
        net.load_hf_state_dict(weights)
    net.eval().requires_grad_(False)
    tokenizer = load_tokenizer(folder, config)
    return LoadedModel(net, config, tokenizer, fingerprint(folder, files), folder)


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    key = dtype.removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def resolve_model_dir(model: str | Path | None) -> Path:
    """The HF folder to read: a local folder or .gguf file (converted once, cached), or a Hub id
    that is no local path (runner/model/hub.py); checks that config.json exists."""
    if model is None:
        return convert_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if not path.exists():
        if isinstance(model, str) and looks_like_hub_id(model):
            return resolve_hub_model(model)  # from the Hugging Face cache, else downloaded
        raise ValueError(
            f"model path not found: {path} (a local HF folder, a .gguf file or a Hugging Face "
            "Hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct' is expected)"
        )
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert_gguf(path)
        raise ValueError(f"{path} is a file but not a .gguf; pass a folder with config.json")
    path = path.resolve()
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        raise ValueError(f"no config.json in model folder {path}")
    return path


def read_config(folder: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # unknown model_type, bad JSON...: name the file
        raise ValueError(f"cannot read {folder / 'config.json'}: {e}") from e
    config = text_config(config)
    resolve_architecture(config)
    return config


def generation_eos_ids(folder: Path) -> set[int]:
    """The end-of-sequence ids that the folder's generation_config.json names (chat models list
    their end-of-turn token there, such as Gemma 3's <end_of_turn>, which transformers'
    `generate` stops at too); empty when the file is absent or names none."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (ValueError, AttributeError) as e:  # not JSON, or not an object
        raise ValueError(f"cannot read {path}: {e}") from e
    if eos is None:
        return set()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id {eos!r} is not a token id or a list of them")
    return set(ids)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder (all shards of an index), else ValueError."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"corrupt safetensors index {index}: {e}") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt*")
        )
        hint = f" (found {', '.join(other)}; only safetensors are supported)" if other else ""
        raise ValueError(f"no *.safetensors weights in {folder}{hint}")
    return files


# torch.nn.init's random fills and the tensor methods they end in.
_RANDOM_INITS = frozenset(
    {
        "normal_",
        "uniform_",
        "trunc_normal_",
        "kaiming_normal_",
        "kaiming_uniform_",
        "xavier_normal_",
        "xavier_uniform_",
    }
)


class SkipMetaInit(TorchFunctionMode):
    """While active, a random initialisation of a meta tensor returns it untouched: a meta
    tensor holds no values to draw. Torch would run nn.Embedding's `normal_` through its Python
    reference, which first imports the compiler (torch._dynamo): ~0.6 s of start-up for values
    that the weights overwrite anyway. It sees `torch.nn.init.normal_` (say) before the tensor
    method it calls, so both names are matched."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes `tensor=`
        if (
            getattr(func, "__name__", None) in _RANDOM_INITS
            and isinstance(first, torch.Tensor)
            and first.is_meta
        ):
            return first
        return func(*args, **kwargs)


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """Lazy name -> tensor view over safetensors files; a tensor is read when asked for,
    so loading holds one tensor at a time beside the model. As a context manager it closes
    the files (and their memory maps) on exit, instead of whenever it is collected."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self.files = files
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
                names = list(handle.keys())
            except Exception as e:  # SafetensorError: truncated file, bad header
                raise ValueError(f"corrupt safetensors file {f}: {e}") from e
            self._handles[f] = handle
            for name in names:
                self._where[name] = f

    def __getitem__(self, name: str) -> torch.Tensor:
        f = self._where[name]
        try:
            tensor: torch.Tensor = self._handles[f].get_tensor(name)
        except Exception as e:
            raise ValueError(f"corrupt safetensors file {f} (tensor {name!r}): {e}") from e
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __enter__(self) -> SafetensorsWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the open files; tensors already read keep what they need."""
        self._handles.clear()


def load_tokenizer(
    folder: Path, config: PretrainedConfig | None = None
) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, None when it has none. `config`, the folder's config when the
    caller has read it already, spares AutoTokenizer reading config.json a second time."""
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), config=config, local_files_only=True)
    except Exception as e:
        raise ValueError(f"cannot load the tokenizer in {folder}: {e}") from e


def fingerprint(folder: Path, files: list[Path]) -> str:
    """`<folder name>@<16 hex>` over the resolved folder, config.json and the weight files'
    bytes, so weights rewritten in place get another prefix-cache namespace. The bytes come
    from the page cache (which the load fills anyway) through one reused 1 MiB buffer that
    stays in the CPU cache: 0.5 GB in about half the time of reading fresh 16 MiB chunks."""
    h = xxhash.xxh3_128()
    h.update(str(folder.resolve()).encode())
    h.update((folder / "config.json").read_bytes())
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    for f in files:
        h.update(f"{f.name}\0".encode())
        with f.open("rb", buffering=0) as stream:
            while n := stream.readinto(buffer):
                h.update(view[:n])
    return f"{folder.name}@{h.hexdigest()[:16]}"
