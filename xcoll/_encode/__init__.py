"""The encoding layer: how leaves become buffers and travel exactly. Packing
into buckets and their layout (:mod:`~xcoll._encode.pack`), the exact wire
encodings (:mod:`~xcoll._encode.wire`) and the object codec
(:mod:`~xcoll._encode.codec`).

Nothing is imported here: the modules import each other and the other layers,
and an import here would make a cycle."""
