"""The shipped Q4_1 GGUF of the embedded default rewritten with its weights dequantized, in F32 or BF16, so llama.cpp
runs on the same weights as this engine's fp32 and bf16 rows (which load the same file's dequantized values).

    python benchmark/gguf_unquantized.py {f32,bf16} [--out PATH]

Metadata (tokenizer, chat template, hyperparameters) is copied as it is; `general.file_type` says the new type.
Every quantized tensor (the Q4_1 linears, the Q8_0 embedding) is dequantized by gguf's reference code and stored
in the target type; the 1-D tensors (norms) stay F32, as llama.cpp's converter keeps them. Written once under
DEEPINFER_CACHE/gguf and reused.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

FILE_TYPES = {"f32": 0, "bf16": 32}
"""llama.cpp's LlamaFileType: ALL_F32 and MOSTLY_BF16."""


def unquantized_gguf(kind: str, out: Path | None = None) -> Path:
    import gguf

    from deepinfer_rt.env import get_env
    from deepinfer_rt.models.smollm2 import gguf_path

    if kind not in FILE_TYPES:
        raise ValueError(f"kind must be one of {tuple(FILE_TYPES)}, got {kind!r}")
    src = gguf_path()
    out = out or get_env().cache_dir / "gguf" / src.name.replace("Q4_1", kind.upper())
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    target = gguf.GGMLQuantizationType.F32 if kind == "f32" else gguf.GGMLQuantizationType.BF16
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = FILE_TYPES[kind] if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        vtype = field.types[0]
        writer.add_key_value(field.name, value, vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # logical shape, row-major
        if values.ndim == 1 or target == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, values)
        else:  # BF16 bytes (uint8): GGUFWriter reads the element shape off the byte shape
            writer.add_tensor(t.name, gguf.quants.quantize(values, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=tuple(FILE_TYPES))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    print(unquantized_gguf(args.kind, args.out))


if __name__ == "__main__":
    main()
