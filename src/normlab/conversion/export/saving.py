"""Saving and loading a converted model: its weights, and the record that rebuilds its structure."""

from __future__ import annotations

import fnmatch
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from normlab.conversion.calibrate.massive import MassiveTokens
from normlab.conversion.calibrate.sites import per_channel_kwargs
from normlab.conversion.export.portable import (
    MODELING_FILE,
    PortableError,
    auto_classes,
    site_spec,
    write_portable,
)
from normlab.corpus import sha256_file
from normlab.record import RECORD_FILE, ConversionRecord
from normlab.sites import swap
from normlab.version import __version__

__all__ = ["RECORD_FILE", "save_converted", "load_converted", "read_record", "apply_record", "module_names",
           "shareable"]  # fmt: skip


def apply_record(model: nn.Module, record: ConversionRecord) -> nn.Module:
    """Rebuild a recorded conversion's structure on a fresh model (no calibration); load the weights after.

    Args:
        model: A fresh model of the recorded architecture (changed in place and returned).
        record: The `ConversionRecord` a save wrote.
    """
    names = {name for name, _ in model.named_modules()}
    missing = [s.name for s in record.sites if s.name not in names]
    if missing:
        raise ValueError(f"the model has no module {missing[0]!r} from the conversion record; is it the same model?")
    spec = record.spec
    for s in record.sites:
        new = spec.create(s.dim, **s.kwargs)
        if s.massive:
            outside = [c for c in s.massive["channels"] if not 0 <= int(c) < s.dim]
            if outside:
                raise ValueError(
                    f"site {s.name}: its massive-token channels {outside} lie outside its {s.dim} channels (the "
                    "record was edited)"
                )
            twin = spec.create(s.dim, **{**s.kwargs, **per_channel_kwargs(spec)})
            new = MassiveTokens(new, twin, s.massive["channels"], s.massive["threshold"], s.massive.get("reference"))
        old = model.get_submodule(s.name)
        ref = next(iter(old.parameters()), None)
        if ref is not None:
            new = new.to(device=ref.device, dtype=ref.dtype)
        swap(model, s.name, new)
    if record.embed_scale:  # the papers' embedding scalar: its value comes with the weights
        from normlab.embed_scale import scale_embeddings

        absent = [n for n in record.embed_scale if n not in names]
        if absent:
            raise ValueError(
                f"the model has no embedding {absent[0]!r} from the conversion record; is it the same model?"
            )
        scale_embeddings(model, record.embed_scale)
    return model


def save_converted(
    model: nn.Module,
    record: ConversionRecord,
    path: str | Path,
    tokenizer: object | None = None,
    identity: dict | None = None,
    portable: bool | None = None,
) -> Path:
    """Save a converted model: its weights and the conversion record, in a folder that `load_converted` reads.

    A Hugging Face model is saved with its own ``save_pretrained`` (config, generation config, weights) and, given
    its ``tokenizer``, the tokenizer too: a complete folder that ``AutoTokenizer.from_pretrained`` reads.

    Args:
        model: the converted model.
        record: its conversion record (`convert_norms`' return).
        path: the folder to write (created; an existing one is written into).
        tokenizer: the model's tokenizer, saved beside it.
        identity: what the model was made from (the config, the model's and the text's fingerprints), recorded
            in ``normlab_conversion.json``.
        portable: whether the folder also loads without normlab, through ``AutoModel...from_pretrained(path,
            trust_remote_code=True)`` (`normlab.conversion.export.portable`). None makes it so wherever an Auto class
            builds the model and records why not elsewhere; True raises a ValueError, before anything is written,
            where it cannot; False skips it.

    Returns:
        The folder's path.
    """
    path = Path(path)
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if source and Path(source).is_dir() and Path(source).resolve() == path.resolve():
        raise ValueError(
            f"save_converted: {path} is the folder the model was loaded from; saving there would replace the "
            "original weights. Choose another folder"
        )
    autos = _portable_plan(model, record, portable)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(path)
    else:
        torch.save(model.state_dict(), path / "model.pt")
    d = record.to_dict()
    d["model_class"] = type(model).__name__
    if isinstance(autos, str):
        d["portable"] = {"loads_without_normlab": False, "auto_classes": [], "why": autos}
    else:
        autos = write_portable(model, path, [s.name for s in record.sites], __version__)
        d["portable"] = {"loads_without_normlab": True, "auto_classes": autos, "modeling_file": MODELING_FILE}
    d["weights_sha256"] = {f.name: sha256_file(f) for f in _weight_files(path)}  # checked by load_converted
    if identity is not None:  # what made it: the source model, the text and the settings (by hash)
        d["made_from"] = identity
    (path / RECORD_FILE).write_text(json.dumps(d, indent=2) + "\n")
    shareable(path)
    return path


def shareable(folder: Path) -> None:
    """Give every file in ``folder`` at least the mode a plain write gives under the user's umask (0644 under umask
    022): transformers writes ``model.safetensors`` through a private temporary file (0600), which would leave the
    weights unreadable to anyone the folder is shared with. A mode the user widened is left as it is.

    Args:
        folder: The folder written.
    """
    mask = os.umask(0)
    os.umask(mask)
    plain = 0o666 & ~mask
    for f in folder.rglob("*"):
        if f.is_file() and not f.is_symlink():
            mode = stat.S_IMODE(f.stat().st_mode)
            if mode & plain != plain:
                f.chmod(mode | plain)


def _portable_plan(model: nn.Module, record: ConversionRecord, portable: bool | None) -> list[str] | str:
    """The Auto classes a portable folder will name, or the sentence saying why there is none (raised where
    ``portable`` is True, before anything is written)."""
    if portable is not None and not isinstance(portable, bool):
        raise TypeError(f"save_converted: portable must be True, False or None, got {portable!r}")
    if portable is False:
        return "not asked for (save_converted(portable=False))"
    try:
        if not hasattr(model, "save_pretrained"):
            raise PortableError(
                f"{type(model).__name__} is not a Hugging Face model; a plain PyTorch model loads with "
                "normlab.load_converted"
            )
        for s in record.sites:
            site_spec(model.get_submodule(s.name), s.name)
        if not auto_classes(model):
            raise PortableError(
                f"{type(model).__name__} is not built by any transformers Auto class, so the folder cannot name a "
                "modeling file; it loads with normlab.load_converted"
            )
    except PortableError as e:
        if portable:
            raise
        return str(e)
    return auto_classes(model)


def module_names(model: nn.Module, state: dict) -> dict:
    """A saved state's keys as the model names its parameters. transformers' ``save_pretrained`` may write legacy
    names (ViT: ``vit.encoder.layer.0`` for ``vit.layers.0``); its own reverse mapping, applied to the model's
    state, says which saved name each parameter gets, and the file's keys are renamed back by it.

    Args:
        model: The model the state is loaded into.
        state: The saved state dict, by its file's names.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers saves the names it loads
        return state
    if not hasattr(model, "config"):
        return state
    own = model.state_dict()
    saved = revert_weight_conversion(model, dict(own))
    name = {id(v): k for k, v in own.items()}  # renamings keep the tensor: a saved key maps to its parameter
    rename = {s: name[id(v)] for s, v in saved.items() if id(v) in name and s != name[id(v)]}
    out = {rename.get(k, k): v for k, v in state.items()}
    built = {k: v for k, v in own.items() if k not in out}  # no saved key names them: built by a conversion
    if built:
        out.update(_gathered(model, built, out, revert_weight_conversion))
    return out


def _gathered(model: nn.Module, wanted: dict, state: dict, revert: Callable) -> dict:
    """The parameters a transformers conversion builds from several saved tensors (a mixture of experts saves each
    expert's matrices apart and holds them stacked): every element's index traced through the conversion's reverse,
    and each saved value put where its index came from. The saved tensors used are taken out of ``state``; a
    parameter not wholly filled is left out (the loader then names it missing)."""
    probe, starts, total = {}, [], 0
    for k, v in wanted.items():
        probe[k] = torch.arange(total, total + v.numel()).view(v.shape)
        starts.append((total, k))
        total += v.numel()
    traced = {s: ids for s, ids in revert(model, probe).items() if s in state and state[s].shape == ids.shape}
    if not traced:
        return {}
    flat = torch.empty(total, dtype=next(iter(wanted.values())).dtype)
    filled = torch.zeros(total, dtype=torch.bool)
    for s, ids in traced.items():
        flat[ids.flatten()] = state.pop(s).flatten().to(flat.dtype)
        filled[ids.flatten()] = True
    ends = [start for start, _ in starts[1:]] + [total]
    return {k: flat[a:b].view(wanted[k].shape).clone() for (a, k), b in zip(starts, ends) if bool(filled[a:b].all())}


def _weight_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".pt") and p.is_file())


def _check_weights(path: Path, recorded: dict | None) -> None:
    """The weight files are the ones the record was saved with (by SHA-256): another converted model's weights of
    the same shape would otherwise load silently. Records from before the field are not checked."""
    if recorded is None:
        return
    if not isinstance(recorded, dict):
        raise ValueError(f"{path / RECORD_FILE}: weights_sha256 must be an object, got {recorded!r}")
    for name, sha in recorded.items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"{path}: the weight file {name} that {RECORD_FILE} records is missing")
        if sha256_file(f) != sha:
            raise ValueError(
                f"{f} is not the file {RECORD_FILE} was saved with (its SHA-256 differs): it was "
                "replaced or edited; convert the model again"
            )


def _rebuild(path: Path, model_class: str | None) -> nn.Module:
    """A fresh Hugging Face model of the saved config, of the recorded class."""
    if not (path / "config.json").exists():
        raise ValueError(f"{path} has no config.json: pass the model to load into (load_converted(path, model))")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path / 'config.json'} cannot be read as a transformers config ({e})") from None
    name = model_class or (config.architectures or [None])[0]
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"{path / RECORD_FILE}: model_class {name!r} is not a transformers model class; pass the "
            "model to load into (load_converted(path, model))"
        )
    want = getattr(cls, "config_class", None)
    if isinstance(want, type) and not isinstance(config, want):
        raise ValueError(
            f"{path}: {RECORD_FILE} names {name}, but config.json is a {type(config).__name__} (model_type "
            f"{getattr(config, 'model_type', None)!r}); the folder holds another family's config: convert the model "
            "again, or pass the model to load into (load_converted(path, model))"
        )
    try:
        return cls(config)
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: {name} cannot be built from its config.json ({type(e).__name__}: {e})") from None


def _load_state(path: Path) -> dict:
    if (path / "model.pt").exists():
        return torch.load(path / "model.pt", map_location="cpu", weights_only=True)
    from safetensors.torch import load_file

    if (path / "model.safetensors").exists():
        try:
            return load_file(path / "model.safetensors")
        except Exception as e:  # noqa: BLE001  (safetensors' own error type for a damaged file)
            raise ValueError(
                f"{path / 'model.safetensors'} is damaged or truncated ({type(e).__name__}: "
                f"{str(e)[:200]}); convert the model again"
            ) from None
    index = path / "model.safetensors.index.json"
    if index.exists():
        state = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(path / shard))
        return state
    raise FileNotFoundError(f"{path}: no model.pt, model.safetensors or sharded safetensors index")


def read_record(folder: str | Path) -> dict:
    """The conversion record of ``folder`` as saved (``normlab_conversion.json``), read in one place: a file that is
    not a JSON object (cut short by a full disk, edited) is named, with the fix, instead of a bare JSON error.

    Args:
        folder: A converted model's folder.
    """
    where = Path(folder) / RECORD_FILE
    try:
        d = json.loads(where.read_text())
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{where} is damaged ({e}); convert the model again") from None
    return d


def load_converted(path: str | Path, model: nn.Module | None = None) -> tuple[nn.Module, ConversionRecord]:
    """Load a model saved by `save_converted`.

    Args:
        path: the folder `save_converted` (or ``normlab convert --out``) wrote.
        model: for a plain PyTorch model, a freshly constructed instance of the original architecture; omitted
            for a Hugging Face model, which is rebuilt from the saved config.

    Returns:
        The converted model (its norms replaced, its weights loaded) and its conversion record.
    """
    path = Path(path)
    if not (path / RECORD_FILE).exists():
        raise FileNotFoundError(f"{path} holds no {RECORD_FILE}: not a model saved by normlab.save_converted")
    where = path / RECORD_FILE
    d = read_record(path)
    try:
        record = ConversionRecord.from_dict(d)
    except ValueError as e:  # a field of the wrong kind, missing or unknown: named
        raise ValueError(f"{where}: {e}; convert the model again") from None
    _check_weights(path, d.get("weights_sha256"))
    saved = _load_state(path)
    if model is None:
        model = _rebuild(path, d.get("model_class"))
        dtypes = {v.dtype for v in saved.values() if v.is_floating_point()}
        if len(dtypes) == 1:  # a bf16 model comes back bf16, as from_pretrained gives it (its config's dtype)
            model = model.to(dtypes.pop())
    try:
        apply_record(model, record)
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a site the model or the norm cannot take
        raise ValueError(
            f"{where}: a site of the record cannot be built ({type(e).__name__}: {e}): the record was edited or "
            "comes from another model; restore the one this folder was saved with, or convert the model again"
        ) from None
    state = module_names(model, saved)
    own = model.state_dict()
    wrong = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items() if k in own and v.shape != own[k].shape]
    if wrong:
        k, got, want = wrong[0]
        raise ValueError(
            f"{path}: the weight {k} has shape {got} where the converted model has {want} (the folder "
            "holds another model's weights, or was edited); convert the model again"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not any(fnmatch.fnmatch(k, t) for t in tied)]
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if unexpected or missing:
        raise ValueError(_mismatch(path, record, model, missing, unexpected))
    return model.eval(), record


def _mismatch(path: Path, record: ConversionRecord, model: nn.Module, missing: list[str], unexpected: list[str]) -> str:
    """Why a folder's weights and the model its record builds disagree, and the fix: at a norm site, the record's
    sites (edited, or another conversion's) against the weights; elsewhere, the weights."""
    keys = [*missing, *unexpected]
    owner = {s.name: s for s in record.sites}
    at = next((k.rsplit(".", 1)[0] for k in keys if k.rsplit(".", 1)[0] in owner), None)
    said = f"missing {missing[:3]}, unexpected {unexpected[:3]}"
    if at is not None:
        site = owner[at]
        return (
            f"{path / RECORD_FILE}: its site {at} ({site.kind} to {record.target}, per {record.per}) builds a norm "
            f"whose weights the folder does not hold ({said}): the record's sites were edited or come from another "
            "conversion; restore the record this folder was saved with, or convert the model again"
        )
    modules = dict(model.named_modules())
    unlisted = next((k.rsplit(".", 1)[0] for k in unexpected if k.rsplit(".", 1)[0] in modules), None)
    if unlisted is not None:
        return (
            f"{path / RECORD_FILE}: the weights hold a converted norm at {unlisted}, which the record does not list "
            f"among its sites ({said}): the record was edited; restore it, or convert the model again"
        )
    return f"{path}: weights do not match the converted model ({said}); the folder was edited: convert the model again"
