"""A conversion's data: what each stage reads (`normlab.conversion.data.config`)."""
