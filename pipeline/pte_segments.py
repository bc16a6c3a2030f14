"""The segment table of a lowered .pte, read and rewritten: ExecuTorch's private serialisation, in one place.

A .pte is a flatbuffer program followed by data segments, each an (offset, size) range of the file that the
program's constant segment and named data point into. Two functions work on that table:
- `share_constant_bytes` points each named-data segment whose bytes equal a constant-segment tensor at that
  tensor, so a tied embedding (a lookup outside the delegate, an lm_head inside it) is stored once;
- `data_layout` says how many bytes each kind of segment holds (the export's report).

The invariant: a rewritten program decodes to the lowered one apart from its segment table, and every segment
reads back the bytes it held; `share_constant_bytes` checks both before returning. Only the table moves, never
a byte a method reads.

Why a module of its own: these functions import executorch.exir._serialize (the flatbuffer codec, the extended
header, the padding rules), which is not a public API and may change with any ExecuTorch release; everything
that depends on it is here, pinned by tests/test_export.py against the runtime that loads the result.
"""

from __future__ import annotations

_TENSOR_ALIGNMENT = 16  # XNNPACK's named-data alignment; also ExecuTorch's default constant tensor alignment
_MAGIC = r"ET[0-9a-zA-Z][0-9a-zA-Z]"


def share_constant_bytes(pte: bytes, *, segment_alignment: int = 128, constant_tensor_alignment: int | None = None,
                         delegate_alignment: int | None = None) -> tuple[bytes, list[tuple[str, int]]]:
    """Point every named-data segment whose bytes equal a constant-segment tensor at that tensor.

    -> (the rewritten program, [(named-data key, bytes)] now read from the constant segment).

    Why: a tied embedding is one Parameter read by two consumers in two places. The lookup
    (aten.embedding) runs outside the delegate, so the emitter stores the table in the program's constant
    segment (one entry per content hash across all methods, so the draft's equal copy adds nothing);
    the lm_head is an XNNPACK fully-connected op, whose static fp32 weight XNNPACK stores untransformed
    in the program's named data, keyed by its sha256 (one entry across all methods). Without this rewrite
    the file holds the table twice. Neither consumer can move: XNNPACK has no gather op, and a delegated
    linear needs its weight static (measured on lookup + norm + tied lm_head alone, vocab 32768 x 64,
    one thread: 0.27 ms a call with the static weight; 3.0 ms with the weight passed in at run time,
    which XNNPACK repacks on every call; 2.2 ms with the lookup as a delegated one-hot matmul, a V x H
    GEMM per token; 25 ms with no delegate); and the runtime resolves the program's own tensors only
    from the constant segment (an EXTERNAL tensor is looked up in a separate .ptd file, never in the
    .pte's named data).

    How: a segment is only an (offset, size) range of the file, and nothing in the format or runtime
    requires ranges to be disjoint (Program::LoadSegment and PteDataMap::get_data load any range; the
    1.5.1 runtime loads and runs such a program, tests/test_export.py). So the named-data segment keeps its index and key and its range becomes the constant
    tensor's bytes; its own copy is dropped and the later segments move up, keeping the alignment their
    offsets had. Only byte-identical data is shared, so a quantised lm_head (int4) keeps its own table.
    The flatbuffer is re-encoded with the same alignments, every segment is checked to read back the
    bytes it held, and the decoded program must equal the original apart from its segment table.
    """
    import numpy as np
    from executorch.exir._serialize._flatbuffer_program import _flatbuffer_to_program, _program_to_flatbuffer
    from executorch.exir._serialize._program import (_ExtendedHeader, _get_extended_header,
                                                     _insert_flatbuffer_header)
    from executorch.exir._serialize.padding import aligned_size, pad_to
    from executorch.exir.schema import DataSegment

    header = _get_extended_header(pte)
    if header is None or header.segment_base_offset == 0:
        return pte, []
    program = _flatbuffer_to_program(pte[:header.program_size])
    constants, segments, base = program.constant_segment, list(program.segments), header.segment_base_offset
    if not program.named_data or constants is None or len(constants.offsets) < 2:
        return pte, []
    data = np.frombuffer(pte, dtype=np.uint8)

    def at(offset: int, size: int):
        return data[base + offset: base + offset + size]

    const_seg = segments[constants.segment_index]
    ends = list(constants.offsets[1:]) + [const_seg.size]
    tensors = [(off, end - off) for off, end in zip(constants.offsets, ends) if end > off]
    shared: dict[int, int] = {}  # named-data segment index -> its tensor's offset in the constant segment
    for index in sorted({entry.segment_index for entry in program.named_data}):
        seg = segments[index]
        if const_seg.offset <= seg.offset < const_seg.offset + const_seg.size:
            continue  # already a range of the constant segment
        for off, span in tensors:  # span = tensor bytes + padding below the tensor alignment
            if (0 <= span - seg.size < _TENSOR_ALIGNMENT and (const_seg.offset + off) % _TENSOR_ALIGNMENT == 0
                    and np.array_equal(at(seg.offset, seg.size), at(const_seg.offset + off, seg.size))):
                shared[index] = off
                break
    if not shared:
        return pte, []

    offsets, end = {}, 0
    for index, seg in enumerate(segments):
        if index not in shared:
            offsets[index] = aligned_size(end, min(seg.offset & -seg.offset, 4096) if seg.offset else 4096)
            end = offsets[index] + seg.size
    for index, off in shared.items():
        offsets[index] = offsets[constants.segment_index] + off
    program.segments = [DataSegment(offset=offsets[i], size=seg.size) for i, seg in enumerate(segments)]

    flat = _program_to_flatbuffer(program, constant_tensor_alignment=constant_tensor_alignment,
                                  delegate_alignment=delegate_alignment)
    header_size = aligned_size(_ExtendedHeader.EXPECTED_LENGTH, flat.max_alignment)
    program_size = header_size + len(flat.data)
    new_base = aligned_size(program_size, segment_alignment)
    new_header = pad_to(_ExtendedHeader(program_size=program_size, segment_base_offset=new_base,
                                        segment_data_size=end).to_bytes(), header_size)
    out = np.zeros(new_base + end, dtype=np.uint8)
    out[:program_size] = np.frombuffer(_insert_flatbuffer_header(flat.data, _MAGIC, new_header), dtype=np.uint8)
    for index, seg in enumerate(segments):
        if index not in shared:
            out[new_base + offsets[index]: new_base + offsets[index] + seg.size] = at(seg.offset, seg.size)

    for index, seg in enumerate(segments):  # every range reads back what it held
        if not np.array_equal(out[new_base + offsets[index]: new_base + offsets[index] + seg.size],
                              at(seg.offset, seg.size)):
            raise AssertionError(f"share_constant_bytes: segment {index} does not read back its bytes")
    decoded = _flatbuffer_to_program(out[:program_size].tobytes())
    if _get_extended_header(out[:64].tobytes()).segment_base_offset != new_base or decoded.segments != program.segments:
        raise AssertionError("share_constant_bytes: the rewritten header or segment table does not decode")
    decoded.segments = segments
    if decoded != _flatbuffer_to_program(pte[:header.program_size]):
        raise AssertionError("share_constant_bytes: the re-encoded program differs from the lowered one")
    keys = {entry.segment_index: entry.key for entry in program.named_data}
    return out.tobytes(), [(keys[i], segments[i].size) for i in sorted(shared)]


def data_layout(pte: bytes) -> dict[str, int]:
    """Where a program's bytes are: {"file", "constant", "named_data" (stored on its own), "named_data_shared"
    (read from the constant segment), "other_segments" (delegate payloads, mutable data)} in bytes."""
    from executorch.exir._serialize._flatbuffer_program import _flatbuffer_to_program
    from executorch.exir._serialize._program import _get_extended_header

    layout = {"file": len(pte), "constant": 0, "named_data": 0, "named_data_shared": 0, "other_segments": 0}
    header = _get_extended_header(pte)
    if header is None or header.segment_base_offset == 0:
        return layout
    program = _flatbuffer_to_program(pte[:header.program_size])
    segments = program.segments
    const = program.constant_segment.segment_index if program.constant_segment else None
    lo, hi = (segments[const].offset, segments[const].offset + segments[const].size) if const is not None else (0, 0)
    named = {entry.segment_index for entry in program.named_data or ()}
    for index, seg in enumerate(segments):
        if index == const:
            layout["constant"] += seg.size
        elif index in named:
            inside = const is not None and lo <= seg.offset and seg.offset + seg.size <= hi
            layout["named_data_shared" if inside else "named_data"] += seg.size
        else:
            layout["other_segments"] += seg.size
    return layout
