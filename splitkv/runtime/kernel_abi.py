"""The decode kernels' arguments as the host writes them: Python mirrors of ``DecodeParams`` and
``ChunkRecord`` (``kernels_cu/decode_params.cuh``), field by field.

``DecodeParams`` is a ctypes structure: one per plan, its address is the one kernel argument of
both kernels (``launch.KernelLaunch``). ``CHUNK_RECORD`` is a NumPy structured dtype: the plan's
records are an array of it (``records.chunk_records``). ``layout_checks()`` turns both mirrors into
C++ ``static_assert``s on every field's offset, size and kind, which ``KernelBuild.source()``
appends to decode.cu: a kernel whose structs differ from these mirrors does not compile. Needs
neither CuPy nor a GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..core.geometry import RECORD_PAGES

_POINTER = ctypes.c_void_p      # device pointers, written as Python ints


class DecodeParams(ctypes.Structure):
    """``DecodeParams`` of decode_params.cuh (the comments there say what each field holds)."""

    _fields_ = [
        ("q", _POINTER),
        ("k_cache", _POINTER),
        ("v_cache", _POINTER),
        ("page_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64),
        ("kv_indices", _POINTER),
        ("records", _POINTER),
        ("merge_indptr", _POINTER),
        ("out", _POINTER),
        ("lse", _POINTER),
        ("partial_o", _POINTER),
        ("partial_lse", _POINTER),
        ("counters", _POINTER),
        ("batch_size", ctypes.c_int32),
        ("num_qo_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("ctas_per_kv_head", ctypes.c_int32),
        ("page_size", ctypes.c_int32),
        ("sm_scale_log2", ctypes.c_float),
        ("pages_in_record", ctypes.c_int32),
        ("pdl_early_trigger", ctypes.c_int32),
        ("k_scale", _POINTER),
        ("v_scale", _POINTER),
        ("k_scale_value", ctypes.c_float),
        ("v_scale_value", ctypes.c_float),
        ("k_scale_stride", ctypes.c_int32),
        ("v_scale_stride", ctypes.c_int32),
        ("logits_soft_cap_log2", ctypes.c_float),
        ("sinks", _POINTER),
        ("head_stride", ctypes.c_int64),
        ("query_rows", _POINTER),
        ("q_group", ctypes.c_int),
        ("unified_max_log2", ctypes.c_float),
        ("unified_fallbacks", _POINTER),
        ("split_requests", _POINTER),
        ("num_split_requests", ctypes.c_int),
        ("q_stride", ctypes.c_int64),
        ("alibi_slopes_log2", _POINTER),
    ]


# ChunkRecord: its ChunkHeader (eight int32), then the page ids of the chunk's first pages.
CHUNK_HEADER_FIELDS = ("request", "token_begin", "token_end", "page_table_begin", "chunk_begin",
                       "chunk_end", "plan_index", "flags")
CHUNK_RECORD = np.dtype([*((name, np.int32) for name in CHUNK_HEADER_FIELDS),
                         ("first_pages", np.int32, (RECORD_PAGES,))])

# ChunkHeader.flags bits (decode_params.cuh's RECORD_*), and the request of an idle record.
RECORD_FLAGS = {"RECORD_TICKET_MERGE": 1, "RECORD_HAS_PAGES": 2}
RECORD_TICKET_MERGE, RECORD_HAS_PAGES = RECORD_FLAGS.values()
IDLE_REQUEST = -1

# How a field's C++ type is told apart in the checks: ABI_KIND<T>::value.
ABI_KINDS = {_POINTER: 1, ctypes.c_int64: 2, ctypes.c_int32: 3, ctypes.c_float: 4, ctypes.c_double: 5}
_KIND_TRAIT = """\
template <typename T> struct ABI_KIND { static constexpr int value = 0; };
template <typename T> struct ABI_KIND<T*> { static constexpr int value = 1; };
template <> struct ABI_KIND<long long> { static constexpr int value = 2; };
template <> struct ABI_KIND<int> { static constexpr int value = 3; };
template <> struct ABI_KIND<float> { static constexpr int value = 4; };
template <> struct ABI_KIND<double> { static constexpr int value = 5; };
template <typename T, decltype(sizeof(0)) N> struct ABI_KIND<T[N]> {
  static constexpr int value = ABI_KIND<T>::value;
};
"""


def struct_fields(struct: str, mirror) -> list[tuple[str, str, int, int, int]]:
    """The fields of a ctypes mirror of the C++ struct ``struct``: (struct, member, byte offset,
    byte size, ABI kind), in memory order; an array field has its element's kind."""
    out = []
    for name, ctype in mirror._fields_:
        element = ctype._type_ if issubclass(ctype, ctypes.Array) else ctype
        out.append((struct, name, getattr(mirror, name).offset, getattr(mirror, name).size,
                    ABI_KINDS[element]))
    return out


def record_fields(struct: str, header: str = "header.") -> list[tuple[str, str, int, int, int]]:
    """ChunkRecord's fields as ``struct`` holds them (its header fields under ``header``)."""
    out = []
    for name in CHUNK_RECORD.names:
        dtype, offset = CHUNK_RECORD.fields[name][:2]
        member = f"{header}{name}" if name in CHUNK_HEADER_FIELDS else name
        out.append((struct, member, offset, dtype.itemsize, ABI_KINDS[ctypes.c_int32]))
    return out


def fields() -> list[tuple[str, str, int, int, int]]:
    """Every field of both decode mirrors: (struct, C++ member designator, byte offset, byte
    size, ABI kind), in memory order."""
    return struct_fields("DecodeParams", DecodeParams) + record_fields("ChunkRecord")


SIZES = {"DecodeParams": ctypes.sizeof(DecodeParams), "ChunkRecord": CHUNK_RECORD.itemsize}


def static_asserts(sizes: dict, constants: dict, field_list, where: str) -> str:
    """C++ static_asserts: each struct of ``sizes`` has that size, each constant of
    ``constants`` that value, and every field of ``field_list`` (``fields()``'s tuples) exists
    with that size and kind. (NVRTC has no offsetof; ``offset_probe`` lets a test read the
    offsets from PTX.)"""
    lines = [f"// Layout checks: {where}", _KIND_TRAIT]
    lines += [f'static_assert(sizeof({struct}) == {size}, "sizeof({struct}) {where}");'
              for struct, size in sizes.items()]
    lines += [f'static_assert({name} == {value}, "{name} {where}");'
              for name, value in constants.items()]
    for struct, member, _, nbytes, kind in field_list:
        access = f"((({struct}*)0)->{member})"
        lines.append(f"static_assert(sizeof{access} == {nbytes} && "
                     f"ABI_KIND<decltype{access}>::value == {kind}, "
                     f'"{struct}.{member} {where}");')
    return "\n".join(lines) + "\n"


def layout_checks() -> str:
    """The static_asserts for a source that includes decode_params.cuh: both structs have the
    mirrors' sizes, the record flags their values, and every field the mirrors' name, size and
    kind."""
    return static_asserts(SIZES, RECORD_FLAGS, fields(), "differs from runtime/kernel_abi.py")


def offset_probe(field_list=None) -> str:
    """A kernel that stores each field's offset (in ``field_list`` order, default ``fields()``)
    to out[i]: the compiler folds them to constants, so its PTX holds the structs' real layout."""
    stores = "".join(f"  out[{i}] = (unsigned long long)&((({struct}*)0)->{member});\n"
                     for i, (struct, member, *_) in enumerate(field_list or fields()))
    return ('extern "C" __global__ void abi_offsets(volatile unsigned long long* out) {\n'
            + stores + "}\n")
