"""Plug-ins for the frameworks models are trained with (torchtitan); each imports its framework, normlab does not."""
