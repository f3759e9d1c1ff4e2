"""A conversion's data, in one place: what each stage reads (`normlab.conversion.data.config`, the config's
``[data]`` section), the models and texts (`normlab.conversion.data.models`: the real models fetched once, the
texts cut into calibration, held-out, validation and stream parts), the second text and the texts of one run
(`normlab.conversion.data.texts`), and the original's own samples (`normlab.conversion.data.samples`)."""
