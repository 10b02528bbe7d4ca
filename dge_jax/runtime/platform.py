"""The platform's choices in one place: one frozen value, decided by where the arrays live.

XLA:CPU, TPUs and GPUs want different programs for the same numbers. Every choice that
depends on the platform is a field of `Backend`, and nothing else in the library asks which
platform it runs on. `current(attention)` makes the value for the devices a computation runs
on: the platform of the mesh set by `jax.set_mesh` (what `generate` sets for a model loaded
on a mesh, and what compiling for a TPU from a machine without one sets), else the default
device's. To compile for another platform without a mesh, set a 1 x 1 mesh of its device.

    field                  cpu          tpu            gpu            why
    attention ("auto")     xla          pallas         xla            see ATTENTION
                                                                      (prefill and decode)
    layer_loop             unrolled     scan           unrolled       XLA:CPU copies a scanned
                                                                      layer's slices each step;
                                                                      a scan decodes at half
                                                                      speed on GPU too
    prefill_chunk          512          8192           8192           see below
    prefill_step_tokens    -            8192           8192           batch x chunk, at most
    prompt_bucket          512          512            512            padding past one chunk
    key_block              = chunk      512            512            XLA path's score tiles
    keys_major_max_rows    16           0              0              an XLA:CPU speed choice
    write_after_attention  True         False          False          an XLA:CPU copy fix
    int4_pieces            1            8              8              see below

Prefill chunk. Each prefill step reads every weight once, so a 32k prompt in 512-token steps
reads an 8B model's weights 64 times (159 GB of HBM traffic per device on a v5e-8 against
about 2 GB of weights). On TPU and GPU a step holds about 8192 tokens of all rows
together (`chunk_for`: a device's rows x chunk <= `prefill_step_tokens`, the chunk a
multiple of the 512-token `prompt_bucket` and at most `prefill_chunk`): at batch 1 the
weights are read once for prompts up to 8k and 4 times at 32k, and a step's activations
stay bounded whatever the batch (compiled for a v5e-8, an 8B model's prefill at batch 24 in
8192-token chunks needs 19 GiB of temporaries; in 512-token ones it fits:
benchmarks/RESULTS.md). 8192 tokens per weight read sits far past every chip's roofline
ridge (about 240-600 flops per byte), so the weights' re-reads cost traffic, not time.
Prompts are padded to multiples of 512 and split into equal steps of at most the chunk
(`prompts.bucket_length`), so a long chunk costs no padding. CPU keeps 512 at every batch:
measured fastest there (benchmarks/RESULTS.md).

The other CPU fields: one layer per decode group, because XLA:CPU copies the slice of a
stacked array a scanned layer reads, every step (`decoding.decode_loop`); keys-major score
products for a handful of query rows, faster on XLA:CPU (`attention.cached_attention`); and
the zero that orders a decode step's cache write after attention's reads, without which
XLA:CPU copied every cache buffer per step (`layer_attention.cache_layer_attention`). On TPU
that zero only adds a scalar to every layer's all-reduce under a mesh, and the TPU
compiler keeps the buffers in place without it (tests/test_platform.py compiles the decode
loop for a v5e and finds no cache copy).

int4 pieces. The rules' window attention and compaction's gather read an int4 layer in this
many pieces of whole blocks (`quantized.over_pieces`), so no layer is dequantized whole: on a
v5e that is what let 72 rows of Llama-8B at 32k fit instead of 64. XLA:CPU pays per op, and
there pieces take several times a whole read (`python -m benchmarks.int4_pieces`,
benchmarks/RESULTS.md, "An int4 cache"), so CPU reads a layer whole. (The Pallas kernels
read an int4 layer in place, `flash_int4` and `flash_decode_int4`, at head dims 128 and 256,
else in pieces, `kernels/int4_pieces.py`.)
"""

from __future__ import annotations

import dataclasses

import jax

from dge_jax.runtime.quantized import PIECES  # int4_pieces on TPU and GPU, as the kernels

ATTENTION = ("auto", "xla", "pallas", "cudnn")
PLATFORMS = ("cpu", "gpu", "tpu")
# What device.platform may say for each platform (GPUs report "gpu", or their runtime).
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
# XLA:CPU's rows limit for keys-major decode scores (G query heads x T tokens per kv head):
# K [S, D] @ Q^T [D, rows] ran the whole attention 1.2-2.3x faster than Q @ K^T for a handful
# of rows (benchmarks/RESULTS.md, "Decode step"; `python -m benchmarks.decode_step`).
CPU_KEYS_MAJOR_MAX_ROWS = 16
CPU_CHUNK = 512
ACCELERATOR_CHUNK = 8192
PROMPT_BUCKET = 512


def check_attention(attention: object) -> str:
    """`attention` when it is one of `ATTENTION`; otherwise one ValueError naming them."""
    if not isinstance(attention, str) or attention not in ATTENTION:
        raise ValueError(
            f"attention must be one of {', '.join(repr(a) for a in ATTENTION)}, got "
            f"{attention!r}: 'auto' picks the platform's (pallas on TPU, xla elsewhere)"
        )
    return attention


@dataclasses.dataclass(frozen=True)
class Backend:
    """Every platform-dependent choice of one computation (module docstring); hashable, so
    it may be a static argument under jit.

    platform: "cpu" | "gpu" | "tpu". attention: the attention implementation ("xla": the
    blocked online softmax of `attention.written_slot_attention`; "pallas":
    `flash.flash_attention`, Mosaic on TPU and interpret mode elsewhere; "cudnn":
    `jax.nn.dot_product_attention`'s cuDNN flash attention, GPU only); decode and draft
    steps run `flash_decode.decode_attention` under "pallas" (the key blocks holding
    visible slots only; steps recording probs sums excepted) and the XLA path
    `attention.cached_attention` otherwise. layer_loop: the decode loop's layer grouping
    (`decoding.decode_groups`). prefill_chunk: tokens per prefill step at most;
    prefill_step_tokens: the rows' tokens per step at most (0: the chunk whatever the
    batch; `chunk_for`); prompt_bucket: prompts longer than it pad to multiples of it (per
    step). key_block: keys per block of the XLA prefill path (0: the chunk).
    keys_major_max_rows: decode scores keys-major up to this many rows per kv head (0:
    never). write_after_attention: order a decode step's cache write after attention's
    reads through a computed zero. int4_pieces: pieces the rules and compaction read an int4
    layer in (1: whole).
    """

    platform: str
    attention: str
    layer_loop: str
    prefill_chunk: int
    prefill_step_tokens: int
    prompt_bucket: int
    key_block: int
    keys_major_max_rows: int
    write_after_attention: bool
    int4_pieces: int

    @classmethod
    def of(cls, platform: str, attention: str = "auto") -> Backend:
        """The choices for `platform` ("cpu", "gpu", "tpu"; "cuda" / "rocm" mean "gpu") with
        attention `attention` ("auto": pallas on TPU, xla elsewhere). cudnn off a GPU
        and unknown names are ValueErrors naming the choice."""
        check_attention(attention)
        name = _ALIASES.get(platform, platform)
        if name not in PLATFORMS:
            raise ValueError(f"unknown platform {platform!r}; known: {', '.join(PLATFORMS)}")
        if attention == "cudnn" and name != "gpu":
            raise ValueError(
                f"attention='cudnn' (cuDNN flash attention, jax.nn.dot_product_attention) "
                f"runs on GPU only, and this computation runs on {name}: choose 'auto', "
                "'xla' or 'pallas'"
            )
        if attention == "auto":
            attention = "pallas" if name == "tpu" else "xla"
        if name == "cpu":
            return cls(name, attention, "unrolled", CPU_CHUNK, 0, CPU_CHUNK, 0,
                       CPU_KEYS_MAJOR_MAX_ROWS, True, 1)  # fmt: skip
        # GPU decode steps run faster in one-layer groups than scanned over the stacked
        # layers, as on CPU (measured: benchmarks.decode_step --llama8b, benchmarks/RESULTS.md)
        loop = "unrolled" if name == "gpu" else "scan"
        return cls(name, attention, loop, ACCELERATOR_CHUNK, ACCELERATOR_CHUNK, PROMPT_BUCKET,
                   512, 0, False, PIECES)  # fmt: skip

    def chunk_for(self, batch: int) -> int:
        """The prefill chunk for `batch` rows on a device (`rows_per_device`):
        `prefill_chunk`, cut so that the rows' tokens per step stay within
        `prefill_step_tokens` (0: no cut), in whole `prompt_bucket`s and at least one. e.g.
        on TPU: batch 1 -> 8192, 4 -> 2048, 24 -> 512 (341 rounded down to one bucket)."""
        if not self.prefill_step_tokens or batch <= 1:
            return self.prefill_chunk
        per_row = self.prefill_step_tokens // batch // self.prompt_bucket * self.prompt_bucket
        return max(self.prompt_bucket, min(self.prefill_chunk, per_row))


def current_platform() -> str:
    """The platform the arrays of this computation live on: the devices of the mesh set by
    `jax.set_mesh` (inside or outside jit), else the default device's."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    if device is not None and getattr(device, "platform", None):
        return device.platform
    default = jax.config.jax_default_device
    if isinstance(default, str):
        return default
    return (default or jax.devices()[0]).platform


def rows_per_device(rows: int) -> int:
    """Rows one device holds of `rows` under the mesh set by `jax.set_mesh` (rows split over
    its "data" axis; all of them without a mesh): what a prefill step's activations scale
    with (`Backend.chunk_for`)."""
    mesh = jax.sharding.get_abstract_mesh()
    data = 1 if mesh.empty else dict(mesh.shape).get("data", 1)
    return -(-rows // data)


def current(attention: str = "auto") -> Backend:
    """`Backend.of` the platform this computation runs on (`current_platform`)."""
    return Backend.of(current_platform(), attention)
