"""MoK per-architecture configuration: loading, validation and derived values.

A config file (YAML) has two sections:

``model``  -- the architecture the kernel settings were tuned for. It is cross-checked against
              Megatron's ``TransformerConfig`` so a config never silently runs on another model.
``kernel`` -- how the megakernel runs: SM split, ring buffer, minibatch size, dtype.

Every key is validated; unknown keys, wrong types and inconsistent values raise
:class:`MokConfigError` naming the file, the key and the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import env

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

#: dtypes the kernel knows. ``mxfp8`` is the Blackwell (sm_100) path; Hopper uses ``fp8``
#: (e4m3 with 1x128 activation / 128x128 weight block scales).
SUPPORTED_DTYPES = ("bf16", "fp8", "mxfp8")
SUPPORTED_ARCHS = ("sm_90a", "sm_100a")
#: SM counts of the GPUs we tune for; used only to validate ``num_sms``.
MAX_SMS = 160
#: Upper bound on ranks one NVLink domain can hold (GB300 NVL72).
MAX_EP_RANKS = 72


class MokConfigError(ValueError):
    """A MoK config is malformed or does not fit the model it is used with.

    ``MokConfigError(source, key, reason)``; ``MokConfigError(message)`` too, as Megatron's ``build_module`` re-raises
    an exception (``type(e)(f"{e} when instantiating ...")``), so the message reaches the user unchanged."""

    def __init__(self, source: str, key: str | None = None, reason: str | None = None) -> None:
        if key is None or reason is None:
            self.source, self.key, self.reason = "", "", source
            super().__init__(source)
            return
        self.source = source
        self.key = key
        self.reason = reason
        super().__init__(f"{source}: key '{key}': {reason}")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts a kernel config was made for (checked against Megatron)."""

    name: str
    hidden_size: int
    moe_ffn_hidden_size: int
    num_moe_experts: int
    moe_router_topk: int
    moe_shared_expert_intermediate_size: int | None = None


@dataclass(frozen=True)
class KernelSpec:
    """How the MoK megakernel runs on one GPU."""

    dtype: str = "bf16"
    arch: str = "sm_90a"
    num_sms: int = 132
    #: SMs set aside for pull dispatch (they also join the final weighted sum). 0: no SM is set aside;
    #: spare warps of every compute SM's producer warpgroup pull the rows beside the GEMM pipeline (the
    #: bf16 forward at EP 1 needs only ~a quarter of 8 comm SMs' copy rate, so 8 SMs of GEMM were lost).
    comm_sms: int = 20
    #: Comm SMs of the backward kernel (0: 2 x comm_sms, at most num_sms - 1; must be set when comm_sms
    #: is 0): it pulls two rows per layout row (x and the output gradient) and does the router gradient
    #: on them.
    backward_comm_sms: int = 0
    ring_slots: int = 4
    #: Rows of the per-expert layout that go through the FFN together (one ring slot).
    minibatch_tokens: int = 0
    #: Minibatch of the backward kernel (0: minibatch_tokens). The backward keeps every routed row in
    #: its layout-order buffers (no ring), so this is only its scheduling granularity: larger ones cut
    #: the per-minibatch dependency waits (Kimi-K2 slice on the H200: 6144 ran 1.22x Megatron's
    #: backward, 2560 / 4096 1.18-1.20x).
    backward_minibatch_tokens: int = 0
    #: GEMM tile used to derive the minibatch from the two-waves rule.
    gemm_tile_m: int = 128
    gemm_tile_n: int = 256
    minibatch_align: int = 64
    #: Spin-wait timeout in the kernel; a stalled flag reports rank/slot after this long.
    timeout_ms: float = 10000.0
    #: Keep fc1 output for backward (True) or recompute it from the saved dispatched rows.
    save_fc1_output: bool = True
    #: bf16 kernel: the forward keeps the expert input rows (layout order) and the SwiGLU output for the
    #: backward -- the rows Megatron's grouped GEMM keeps for its wgrad too -- so the backward kernel
    #: pulls only the output gradient instead of x again (and, with save_fc1_output, does not recompute
    #: act from h). False: a small ring in the forward, x pulled a second time in the backward.
    save_expert_input: bool = True
    #: EP > 1: rows an owner rank's row buffers hold (saved fc1 output, backward x / dY / dH / act rows),
    #: as a multiple of its fair share T * top-k. 0 = the dropless worst case, EP * T * top-k (every
    #: routed row of every rank on one owner). A routing that exceeds it is a clear kernel error, never
    #: a silent drop; at EP 8 a factor of 2 needs a quarter of the worst case's memory.
    owner_capacity_factor: float = 0.0
    #: Ticket order of the forward's GEMM stages: 0 row-block major, 1 n-tile major, G in [2, 64] bands of G row
    #: blocks (a wave's expert weights stay in L2). null: the kernel's measured default, 16 for bf16 (2.6-5.4 %
    #: faster than 0 on the H200) and 0 for fp8 (bands were 1.8-2.7 % slower: its weights are half the bytes).
    #: Changes no result bit.
    tile_raster: int | None = None

    @property
    def forward_tuning(self):
        """The forward kernel's tuning, as its launches take it (``kernel.tuning.ForwardTuning``)."""
        from .kernel.tuning import ForwardTuning

        return ForwardTuning(tile_raster=self.tile_raster)

    @property
    def compute_sms(self) -> int:
        return self.num_sms - self.comm_sms

    @property
    def bwd_comm_sms(self) -> int:
        """backward_comm_sms, or its documented default when 0."""
        return self.backward_comm_sms or min(2 * self.comm_sms, self.num_sms - 1)

    @property
    def bwd_minibatch_tokens(self) -> int:
        """backward_minibatch_tokens, or the forward's minibatch when 0."""
        return self.backward_minibatch_tokens or self.minibatch_tokens


@dataclass(frozen=True)
class MokConfig:
    model: ModelSpec
    kernel: KernelSpec
    source: str = "<memory>"

    # ---- derived values -------------------------------------------------------------------
    @property
    def minibatch_tokens(self) -> int:
        return self.kernel.minibatch_tokens

    @property
    def ring_slots(self) -> int:
        return self.kernel.ring_slots

    @property
    def ring_tokens(self) -> int:
        """Rows the forward's ring buffer holds at once (per rank): a slot holds minibatch_tokens +
        gemm_tile_m - 1 rows, as minibatch boundaries sit on each expert's tile grid (layout.minibatches)."""
        return self.kernel.ring_slots * (self.kernel.minibatch_tokens + self.kernel.gemm_tile_m - 1)

    def ring_bytes(self) -> int:
        """Bytes of the dispatch ring buffer per rank (activations only, no scales)."""
        elem = 2 if self.kernel.dtype == "bf16" else 1
        return self.ring_tokens * self.model.hidden_size * elem

    def replace_kernel(self, **changes: Any) -> MokConfig:
        """A copy with some kernel settings changed (validated again)."""
        raw = dataclasses.asdict(self.kernel) | changes
        # the current minibatch is a concrete value: keep it unless it is changed too
        kernel = _parse_kernel(raw, self.model, self.source, explicit_minibatch=True)
        return MokConfig(model=self.model, kernel=kernel, source=self.source)

    def kernel_warning(self) -> str | None:
        """Why the kernel settings will leave the GPU under-filled (a minibatch below the two-GEMM-waves minimum),
        or None: said once by the layer when the kernel backend runs, not where the config is only read."""
        k = self.kernel
        derived = min_minibatch_tokens(
            self.model.moe_ffn_hidden_size, k.compute_sms, k.gemm_tile_m, k.gemm_tile_n, k.minibatch_align
        )
        if k.minibatch_tokens >= derived:
            return None
        return (
            f"{self.source}: kernel.minibatch_tokens={k.minibatch_tokens} is below the two-GEMM-waves minimum "
            f"{derived} for {k.compute_sms} compute SMs; the expert FFN will under-fill the GPU"
        )

    def check_against(self, transformer_config: Any, ep_size: int | None = None) -> None:
        """Raise if this config was made for another architecture than ``transformer_config``."""
        check_against_transformer_config(self, transformer_config, ep_size)


def min_minibatch_tokens(
    moe_ffn_hidden_size: int, compute_sms: int, tile_m: int = 128, tile_n: int = 256, align: int = 64
) -> int:
    """Smallest minibatch that gives >= 2 full waves of fc1 GEMM tiles on the compute SMs.

    fc1 has N = 2 * ffn (gate and up); its tile count for M rows is (M / tile_m) * (N / tile_n).
    Two waves need 2 * compute_sms tiles. For ffn 2048, 148 compute SMs and 128x256 tiles this
    is exactly the 2368 rows MoK reports for Kimi.
    """
    n_tiles = math.ceil(2 * moe_ffn_hidden_size / tile_n)
    rows = 2 * compute_sms * tile_m / n_tiles
    return int(math.ceil(rows / align) * align)


# ---- parsing ------------------------------------------------------------------------------

_MODEL_KEYS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "hidden_size": int,
    "moe_ffn_hidden_size": int,
    "num_moe_experts": int,
    "moe_router_topk": int,
    "moe_shared_expert_intermediate_size": (int, type(None)),
}
_MODEL_REQUIRED = ("name", "hidden_size", "moe_ffn_hidden_size", "num_moe_experts", "moe_router_topk")
_KERNEL_KEYS: dict[str, type | tuple[type, ...]] = {
    f.name: (
        (int, float)
        if f.type in ("float",)
        else {"int": int, "str": str, "bool": bool, "int | None": (int, type(None))}.get(str(f.type), object)  # type: ignore[dict-item]
    )
    for f in dataclasses.fields(KernelSpec)
}


def _check_type(source: str, key: str, value: Any, expected: type | tuple[type, ...]) -> None:
    # bool is an int subclass: reject it where an int is wanted.
    types = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in types:
        raise MokConfigError(source, key, f"expected {_type_names(types)}, got bool {value!r}")
    if not isinstance(value, types):
        raise MokConfigError(source, key, f"expected {_type_names(types)}, got {type(value).__name__} {value!r}")


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def _parse_model(raw: Any, source: str) -> ModelSpec:
    if not isinstance(raw, Mapping):
        raise MokConfigError(source, "model", "must be a mapping")
    for key in raw:
        if key not in _MODEL_KEYS:
            raise MokConfigError(source, f"model.{key}", f"unknown key (known: {', '.join(_MODEL_KEYS)})")
        _check_type(source, f"model.{key}", raw[key], _MODEL_KEYS[key])
    for key in _MODEL_REQUIRED:
        if key not in raw:
            raise MokConfigError(source, f"model.{key}", "missing required key")
    for key in ("hidden_size", "moe_ffn_hidden_size", "num_moe_experts", "moe_router_topk"):
        if raw[key] <= 0:
            raise MokConfigError(source, f"model.{key}", f"must be positive, got {raw[key]}")
    if raw["moe_router_topk"] > raw["num_moe_experts"]:
        raise MokConfigError(
            source,
            "model.moe_router_topk",
            f"top-k {raw['moe_router_topk']} exceeds num_moe_experts {raw['num_moe_experts']}",
        )
    return ModelSpec(**raw)


def _parse_kernel(raw: Any, model: ModelSpec, source: str, explicit_minibatch: bool | None = None) -> KernelSpec:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise MokConfigError(source, "kernel", "must be a mapping")
    for key in raw:
        if key not in _KERNEL_KEYS:
            raise MokConfigError(source, f"kernel.{key}", f"unknown key (known: {', '.join(_KERNEL_KEYS)})")
        if key == "minibatch_tokens" and raw[key] in (None, "auto"):
            continue
        _check_type(source, f"kernel.{key}", raw[key], _KERNEL_KEYS[key])
    values = {k: v for k, v in raw.items() if not (k == "minibatch_tokens" and v in (None, "auto"))}
    spec = KernelSpec(**values)

    def bad(key: str, reason: str) -> MokConfigError:
        return MokConfigError(source, f"kernel.{key}", reason)

    if spec.dtype not in SUPPORTED_DTYPES:
        raise bad("dtype", f"'{spec.dtype}' is not one of {SUPPORTED_DTYPES}")
    if spec.arch not in SUPPORTED_ARCHS:
        raise bad("arch", f"'{spec.arch}' is not one of {SUPPORTED_ARCHS}")
    if spec.dtype == "mxfp8" and spec.arch != "sm_100a":
        raise bad("dtype", "mxfp8 needs arch sm_100a (Blackwell); Hopper (sm_90a) uses dtype fp8 with block scales")
    if not 1 <= spec.num_sms <= MAX_SMS:
        raise bad("num_sms", f"must be in [1, {MAX_SMS}], got {spec.num_sms}")
    if not 0 <= spec.comm_sms < spec.num_sms:
        raise bad(
            "comm_sms",
            f"must be in [0, num_sms - 1 = {spec.num_sms - 1}] so some SMs compute (0: the pull runs on the "
            f"compute SMs' spare warps), got {spec.comm_sms}",
        )
    if spec.comm_sms == 0 and not spec.backward_comm_sms:
        raise bad(
            "comm_sms",
            "0 (the in-SM pull) needs backward_comm_sms set (>= 1): the backward kernel runs its pulls and "
            "router gradient on dedicated SMs, and its default (2 x comm_sms) would be 0",
        )
    if spec.backward_comm_sms and not 1 <= spec.backward_comm_sms < spec.num_sms:
        raise bad(
            "backward_comm_sms",
            f"must be 0 (2 x comm_sms) or in [1, num_sms - 1 = {spec.num_sms - 1}], got {spec.backward_comm_sms}",
        )
    bmb = spec.backward_minibatch_tokens
    if bmb and (bmb < 0 or bmb % spec.minibatch_align):
        raise bad(
            "backward_minibatch_tokens",
            f"must be 0 (minibatch_tokens) or a positive multiple of minibatch_align={spec.minibatch_align}, got {bmb}",
        )
    if spec.ring_slots < 2:
        raise bad(
            "ring_slots",
            f"needs >= 2 slots so dispatch of one minibatch overlaps compute of another, got {spec.ring_slots}",
        )
    for key in ("gemm_tile_m", "gemm_tile_n", "minibatch_align"):
        v = getattr(spec, key)
        if v <= 0 or v & (v - 1):
            raise bad(key, f"must be a positive power of two, got {v}")
    if spec.timeout_ms <= 0:
        raise bad("timeout_ms", f"must be positive, got {spec.timeout_ms}")
    if spec.tile_raster is not None and not 0 <= spec.tile_raster <= 64:
        raise bad(
            "tile_raster", f"must be null (the measured default) or an integer in [0, 64], got {spec.tile_raster}"
        )
    if spec.owner_capacity_factor != 0 and not spec.owner_capacity_factor >= 1.0:
        raise bad(
            "owner_capacity_factor",
            f"must be 0 (worst case, EP x T x top-k rows) or >= 1.0 (x the fair share T x top-k), "
            f"got {spec.owner_capacity_factor}",
        )
    if (spec.dtype != "bf16") and (model.hidden_size % 128 or model.moe_ffn_hidden_size % 128):
        raise bad(
            "dtype",
            f"{spec.dtype} block scales need hidden_size and moe_ffn_hidden_size multiples of 128, got "
            f"{model.hidden_size} / {model.moe_ffn_hidden_size}",
        )

    derived = min_minibatch_tokens(
        model.moe_ffn_hidden_size, spec.compute_sms, spec.gemm_tile_m, spec.gemm_tile_n, spec.minibatch_align
    )
    if explicit_minibatch is None:
        explicit_minibatch = "minibatch_tokens" in values
    if not explicit_minibatch:
        spec = dataclasses.replace(spec, minibatch_tokens=derived)
    else:
        mb = spec.minibatch_tokens
        if mb <= 0:
            raise bad("minibatch_tokens", f"must be positive, got {mb}")
        if mb % spec.minibatch_align:
            raise bad("minibatch_tokens", f"must be a multiple of minibatch_align={spec.minibatch_align}, got {mb}")
    return spec


def parse_config(raw: Any, source: str = "<memory>") -> MokConfig:
    """Build a :class:`MokConfig` from an already-loaded YAML mapping."""
    if not isinstance(raw, Mapping):
        raise MokConfigError(source, "<root>", "must be a mapping with 'model' and 'kernel' sections")
    for key in raw:
        if key not in ("model", "kernel"):
            raise MokConfigError(source, key, "unknown top-level key (known: model, kernel)")
    if "model" not in raw:
        raise MokConfigError(source, "model", "missing required section")
    model = _parse_model(raw["model"], source)
    kernel = _parse_kernel(raw.get("kernel"), model, source)
    return MokConfig(model=model, kernel=kernel, source=source)


def load_config(name_or_path: str | Path) -> MokConfig:
    """Load a config by bundled name (``"kimi-k2"``) or by path to a YAML file."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise MokConfigError(
            str(name_or_path), "<file>", f"no such config file; bundled: {', '.join(bundled_configs())}"
        )
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise MokConfigError(str(path), "<file>", f"invalid YAML: {exc}") from exc
    return parse_config(raw, str(path))


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def derive_config(transformer_config: Any, *, name: str = "derived", **kernel: Any) -> MokConfig:
    """A config for a model with no bundled YAML: kernel settings derived from its sizes."""
    model = model_spec_from_transformer_config(transformer_config, name)
    return MokConfig(model=model, kernel=_parse_kernel(kernel, model, f"<derived:{name}>"), source=f"<derived:{name}>")


def model_spec_from_transformer_config(tc: Any, name: str = "megatron") -> ModelSpec:
    ffn = tc.moe_ffn_hidden_size if tc.moe_ffn_hidden_size is not None else tc.ffn_hidden_size
    return ModelSpec(
        name=name,
        hidden_size=tc.hidden_size,
        moe_ffn_hidden_size=ffn,
        num_moe_experts=tc.num_moe_experts,
        moe_router_topk=tc.moe_router_topk,
        moe_shared_expert_intermediate_size=getattr(tc, "moe_shared_expert_intermediate_size", None),
    )


def check_against_transformer_config(cfg: MokConfig, tc: Any, ep_size: int | None = None) -> None:
    """Cross-check the model section against Megatron's config and EP size."""
    actual = model_spec_from_transformer_config(tc, cfg.model.name)
    for key in ("hidden_size", "moe_ffn_hidden_size", "num_moe_experts", "moe_router_topk"):
        want, got = getattr(cfg.model, key), getattr(actual, key)
        if want != got:
            raise MokConfigError(
                cfg.source, f"model.{key}", f"config says {want} but the Megatron TransformerConfig has {got}"
            )
    if ep_size is not None:
        if ep_size > MAX_EP_RANKS:
            raise MokConfigError(
                cfg.source,
                "expert_model_parallel_size",
                f"EP={ep_size} exceeds one NVLink domain ({MAX_EP_RANKS} GPUs); MoK pulls through peer memory "
                "and cannot span domains: use --moe-token-dispatcher-type flex (HybridEP/DeepEP) instead",
            )
        if cfg.model.num_moe_experts % ep_size:
            raise MokConfigError(
                cfg.source,
                "expert_model_parallel_size",
                f"num_moe_experts={cfg.model.num_moe_experts} is not divisible by EP size {ep_size}",
            )


@dataclass
class _ConfigState:
    active: MokConfig | None = None


_STATE = _ConfigState()


def set_active_config(cfg: MokConfig | str | Path | None) -> MokConfig | None:
    """Set the config every MoK layer built afterwards uses (None: pick per model)."""
    _STATE.active = load_config(cfg) if isinstance(cfg, (str, Path)) else cfg
    return _STATE.active


def megatron_args_mok_config() -> str | None:
    """``--mok-config`` of the running Megatron-LM job, if any."""
    try:
        from megatron.training import global_vars
    except Exception:  # noqa: BLE001
        return None
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    return getattr(args, "mok_config", None) if args is not None else None


def resolve_config(tc: Any, ep_size: int | None = None) -> MokConfig:
    """The config a MoK layer built from ``tc`` uses.

    Order: ``tc.mok_config`` (a MokConfig or a name/path), the config set by
    :func:`set_active_config`, Megatron-LM's ``--mok-config``, ``$MOK_CONFIG``, the bundled YAML whose model section matches
    ``tc`` exactly, else one derived from the model sizes (logged, never silent).
    """

    explicit = getattr(tc, "mok_config", None)
    if explicit is None:
        explicit = _STATE.active
    if explicit is None:
        explicit = megatron_args_mok_config()
    if explicit is None:
        explicit = env.config_name()
    if isinstance(explicit, (str, Path)):
        explicit = load_config(explicit)
    if explicit is not None:
        explicit.check_against(tc, ep_size)
        return explicit
    actual = model_spec_from_transformer_config(tc)
    for name in bundled_configs():
        cfg = load_config(name)
        m = cfg.model
        if (m.hidden_size, m.moe_ffn_hidden_size, m.num_moe_experts, m.moe_router_topk) == (
            actual.hidden_size,
            actual.moe_ffn_hidden_size,
            actual.num_moe_experts,
            actual.moe_router_topk,
        ):
            cfg.check_against(tc, ep_size)
            logger.info("MoK: using bundled config %s", cfg.source)
            return cfg
    cfg = derive_config(tc)
    cfg.check_against(tc, ep_size)
    logger.warning(
        "MoK: no config given and no bundled config matches hidden=%d ffn=%d experts=%d topk=%d; "
        "using derived kernel settings %s (set MOK_CONFIG or --mok-config to choose)",
        actual.hidden_size,
        actual.moe_ffn_hidden_size,
        actual.num_moe_experts,
        actual.moe_router_topk,
        cfg.kernel,
    )
    return cfg
