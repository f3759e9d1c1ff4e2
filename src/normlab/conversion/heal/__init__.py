"""Healing: the converted model trained toward the original within a budget (``distill``: end to end, or
``blocks``: block by block), its loop and checkpoint (``loop``), low-rank adapters (``lora``), the original's own
samples (``samples``), a cached teacher (``teacher``), and its curve (``report``)."""

from normlab.conversion.data.samples import Starts
from normlab.conversion.data.streams import heal_splits, own_samples
from normlab.conversion.heal.distill import check_heal_resources, distill_loss, heal
from normlab.conversion.heal.loop import HealReport
from normlab.conversion.heal.lora import add_lora, merge_lora
from normlab.conversion.heal.teacher import TeacherCache

__all__ = ["HealReport", "Starts", "TeacherCache", "add_lora", "check_heal_resources", "distill_loss", "heal",
           "heal_splits", "merge_lora", "own_samples"]  # fmt: skip
