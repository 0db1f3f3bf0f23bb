"""What the fragment layout's users share without Triton (kernels/w4a16_fragment.py describes
the layout): the repack and its inverse, the config of a row bucket, and the table of measured
configs (kernels/configs/w4a16_fragment.json, written by benchmarks/kernels/w4a16_fragment.py
--write-configs). A weight shape is served in this layout on a card only where that table has
it: there the layout was timed faster than kernels/w4a16.py's over the row counts measured."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch

from . import validation
from ._tuned import device_name, load_table

OP = "w4a16_fragment_matmul"
SLAB = 64  # a warpgroup's rows of the MMA (columns of the output), and the K step
# Value khalf * 4 + rowhalf * 2 + pair of a word (its order in the fragment) is its field
# pair * 4 + khalf * 2 + rowhalf, so a register's pair is fields r and r + 4.
FIELD_OF_VALUE = tuple(pair * 4 + khalf * 2 + rowhalf for khalf in (0, 1) for rowhalf in (0, 1) for pair in (0, 1))


@dataclass(frozen=True)
class FragmentConfig:
    block_m: int = 64  # activation rows a program (the MMA's N: 8 to 256)
    slabs: int = 1  # 64-column slabs a program, one warpgroup (four warps) each
    split_k: int = 0  # 0: enough K slices for about two programs per SM
    num_stages: int = 3
    ksteps: int = 1  # steps of 64 along K an iteration (of one group: its zeros and scales load once)
    # "mma": this file's kernel; "dequant": the weight widened to 16 bits once
    # (`fragment_dequantize`), then one cuBLAS GEMM (many rows, where the GEMM's time dominates).
    method: str = "mma"

    def __post_init__(self) -> None:
        if self.method not in ("mma", "dequant"):
            raise ValueError(f"method {self.method!r}: expected 'mma' or 'dequant'")
        if self.slabs not in (1, 2, 4) or self.ksteps not in (1, 2, 4):
            raise ValueError(f"slabs {self.slabs} and ksteps {self.ksteps}: each 1, 2 or 4")


def fragment_order(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """[128, 32] (n, k) within a slab of each thread's values, in register order."""
    t = torch.arange(128, device=device)
    warp, g, tid = t // 32, (t // 4) % 8, t % 4
    i = torch.arange(32, device=device)
    kstep, khalf, rowhalf, pair = i // 8, (i // 4) % 2, (i // 2) % 2, i % 2
    rows = warp[:, None] * 16 + rowhalf[None, :] * 8 + g[:, None]
    cols = kstep[None, :] * 16 + khalf[None, :] * 8 + tid[:, None] * 2 + pair[None, :]
    return rows, cols


def repack_fragment(values: torch.Tensor) -> torch.Tensor:
    """values [K, N], integers 0..15 (row k multiplies x[:, k], or x[:, perm[k]] with act-order)
    -> words [K / 64, N / 64, 128, 4] int32 in fragment order."""
    k, n = values.shape
    if k % SLAB or n % SLAB:
        raise ValueError(f"{OP}: K ({k}) and N ({n}) must be multiples of {SLAB}")
    rows, cols = fragment_order(values.device)
    tiles = values.reshape(k // SLAB, SLAB, n // SLAB, SLAB).permute(0, 2, 1, 3)  # [ks, slab, k, n]
    vals = tiles[:, :, cols, rows].to(torch.int64).reshape(k // SLAB, n // SLAB, 128, 4, 8)
    words = sum(vals[..., value] << (4 * field) for value, field in enumerate(FIELD_OF_VALUE))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_fragment(words: torch.Tensor) -> torch.Tensor:
    """`repack_fragment`'s inverse: words [K / 64, N / 64, 128, 4] -> values [K, N] int32."""
    ks, ns = words.shape[:2]
    w = words.to(torch.int64) & 0xFFFFFFFF
    vals = torch.stack([(w >> (4 * field)) & 15 for field in FIELD_OF_VALUE], dim=-1).reshape(ks, ns, 128, 32)
    rows, cols = fragment_order(words.device)
    tiles = torch.empty(ks, ns, SLAB, SLAB, dtype=torch.int64, device=words.device)  # [ks, slab, k, n]
    tiles[:, :, cols, rows] = vals
    return tiles.permute(0, 2, 1, 3).reshape(ks * SLAB, ns * SLAB).to(torch.int32)


TUNED_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "w4a16_fragment.json")
ROW_BUCKETS = (1, 8, 16, 64, 256, 1024)  # and "more": kernels/w4a16.py's buckets
DEFAULT_CONFIGS = {1: FragmentConfig(16, ksteps=2), 8: FragmentConfig(16, ksteps=2), 16: FragmentConfig(16, ksteps=2),
                   64: FragmentConfig(64, ksteps=2), 256: FragmentConfig(128, slabs=2, split_k=1, ksteps=2),
                   1024: FragmentConfig(method="dequant"), 0: FragmentConfig(method="dequant")}


def row_bucket(m: int) -> int:
    """The smallest bucket holding m rows, 0 for more than the largest."""
    return next((b for b in ROW_BUCKETS if m <= b), 0)


def config_key(n: int, k: int, group_size: int, bucket: int) -> str:
    return f"{n}x{k}/w4g{group_size}/m{bucket or 'big'}"


def load_tuned_configs(path: str = TUNED_CONFIGS) -> dict[str, dict[str, FragmentConfig]]:
    """{GPU name: {config_key: config}} from the table; empty when there is none."""
    return load_table(path, FragmentConfig)


def uses_fragment_layout(n: int, k: int, bits: int, group_size: int, device: torch.device,
                         path: str = TUNED_CONFIGS) -> bool:
    """Whether an [N, K] weight of `bits` in groups of `group_size` is repacked into this layout on
    `device`: 4-bit, N, K and the group multiples of 64, and the card's table has the shape."""
    if bits != 4 or n % SLAB or k % SLAB or group_size % SLAB or k % group_size:
        return False
    prefix = f"{n}x{k}/w4g{group_size}/"
    return any(key.startswith(prefix) for key in load_tuned_configs(path).get(device_name(device), {}))


def choose_config(m: int, n: int, k: int, group_size: int, device: torch.device,
                  path: str = TUNED_CONFIGS) -> FragmentConfig:
    """The table's config for this card, shape and row bucket, else the bucket's default (one
    slab a program where its slabs do not divide N, one K step an iteration where its steps do
    not fit a group)."""
    bucket = row_bucket(m)
    table = load_tuned_configs(path).get(device_name(device), {})
    tuned = table.get(config_key(n, k, group_size, bucket))
    if tuned is not None:
        return tuned
    cfg = DEFAULT_CONFIGS[bucket]
    if n % (SLAB * cfg.slabs):
        cfg = replace(cfg, slabs=1)
    return cfg if group_size % (SLAB * cfg.ksteps) == 0 else replace(cfg, ksteps=1)


def config_entry(cfg: FragmentConfig) -> dict:
    """The table's form of a config (the dequant method needs no tile)."""
    return {"method": "dequant"} if cfg.method == "dequant" else asdict(cfg)


def check_arguments(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, perm: torch.Tensor | None, cfg: FragmentConfig,
                    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)) -> tuple[int, int, int]:
    """(M, N, K), or ValueError naming the argument that does not fit (x of one of `dtypes`)."""
    if x.dim() != 2 or x.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        validation.fail(OP, f"x must be a 2-D {names} tensor, got {x.dtype} of shape {tuple(x.shape)}")
    m, k = x.shape
    if words.dim() != 4 or words.dtype != torch.int32 or tuple(words.shape[2:]) != (128, 4) or words.shape[0] * SLAB != k:
        validation.fail(OP, f"words must come from repack_fragment for K = {k}, got {words.dtype} "
                            f"of shape {tuple(words.shape)}")
    n = words.shape[1] * SLAB
    if group_size <= 0 or group_size % SLAB or k % group_size or tuple(scales.shape) != (k // group_size, n) or scales.shape != zeros.shape:
        validation.fail(OP, f"groups of {group_size} (a multiple of {SLAB} dividing K = {k}) need scales and "
                            f"zeros of shape {(k // max(group_size, 1), n)}, got {tuple(scales.shape)} and {tuple(zeros.shape)}")
    if group_size % (SLAB * cfg.ksteps):
        validation.fail(OP, f"groups of {group_size} cannot hold {cfg.ksteps} steps of {SLAB} an iteration")
    if n % (SLAB * cfg.slabs):
        validation.fail(OP, f"N ({n}) must be a multiple of {SLAB * cfg.slabs} for {cfg.slabs} slabs a program")
    if perm is not None and (perm.shape != (k,) or perm.dtype != torch.int32):
        validation.fail(OP, f"perm must be int32 of shape ({k},), got {perm.dtype} of shape {tuple(perm.shape)}")
    return m, n, k
