"""Is a profile for this run? Its device type, model shape and the tessel that wrote it, checked once
for every command that takes `--profile` (plan, simulate, chunk, launch).

A profile prices what it was measured on. One whose device type is not in the cluster, whose layer
shape is not the model's, or that an older or newer tessel (another major.minor) wrote, is refused
with each difference named; with `--force-profile` it is used anyway (the roofline then takes only
its efficiencies where the shape differs) and the same differences are printed as a warning.

A profile of the model at `tessel profile --scale s` (meta "scale") was measured on the model's
layer divided by s: it matches when its shape is the model's shape scaled that way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tessel import __version__
from tessel.cost.profile import PREFILL_BATCH, VERSION_KEY, Profile, load_profile
from tessel.errors import TesselError

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
FORCE_HINT = "--force-profile uses it anyway"


def check_profile(
    profile: Profile,
    device_types: Iterable[str],
    model_shape: dict[str, int],
    model_name: str = "",
    cluster_name: str = "",
) -> list[str]:
    """What differs between `profile` and the run it is given to: one entry per field ([] when it fits).
    `device_types` are the cluster's catalog base names; `model_shape` is `tessel.cost.layer.
    profile_shape(model)`."""
    differences = []
    types = sorted(set(device_types), key=str.lower)
    if profile.device_type.strip().lower() not in {t.lower() for t in types}:
        cluster = f"cluster {cluster_name}" if cluster_name else "the cluster"
        differences.append(f"device type {profile.device_type!r:.60} not in {cluster} ({', '.join(types)})")
    expected = expected_shape(profile, model_shape)
    wrong = [
        f"{key} {profile.model_shape.get(key)} != {value}"
        for key, value in expected.items()
        if profile.model_shape.get(key) != value
    ]
    if wrong:
        scale = _scale(profile)
        timed = f" (the model's layer / {scale}, as profiled)" if scale > 1 else ""
        model = f" (model {model_name})" if model_name else ""
        differences.append(f"model shape {', '.join(wrong)}{timed}{model}")
    written = profile.meta.get(VERSION_KEY)
    if written is not None and _major_minor(written) != _major_minor(__version__):
        differences.append(f"tessel version {written:.20} != {__version__} (this tessel)")
    return differences


def expected_shape(profile: Profile, model_shape: dict[str, int]) -> dict[str, int]:
    """The layer shape `profile` should have been timed at: the model's, or its `--scale` version."""
    scale = _scale(profile)
    if scale <= 1 or set(SHAPE_KEYS) - set(model_shape):
        return dict(model_shape)
    return scaled_shape(model_shape, scale)


def scaled_shape(shape: dict[str, int], factor: int) -> dict[str, int]:
    """A layer's width / factor, same head dim: fewer heads, KV heads >= 1 and dividing the heads (the
    layer `tessel profile --scale` times, `tessel.profiling.layer.LayerShape.scaled`)."""
    if factor <= 1:
        return dict(shape)
    heads = max(1, shape["num_heads"] // factor)
    kv = max(1, shape["num_kv_heads"] // factor)
    while heads % kv:
        kv -= 1
    return {
        "hidden_size": heads * shape["head_dim"],
        "intermediate_size": max(1, shape["intermediate_size"] // factor),
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": shape["head_dim"],
    }


def checked_profiles(
    profiles: Sequence[str | Path | Profile],
    device_types: Iterable[str],
    model_shape: dict[str, int],
    *,
    force: bool = False,
    model_name: str = "",
    cluster_name: str = "",
    warn: Callable[[str], None] | None = None,
) -> list[Profile]:
    """Load `profiles` (paths or loaded) and check each against the run (`check_profile`). A
    difference raises `TesselError` naming every field, unless `force`: then each is warned about
    and the profile is used. A file without a tessel version (an older tessel wrote it) is warned
    about only."""
    warn = warn or warn_profile
    device_types = list(device_types)
    loaded, refused = [], []
    for item in profiles:
        profile = item if isinstance(item, Profile) else load_profile(item)
        name = _label(item, profile)
        differences = check_profile(profile, device_types, model_shape, model_name, cluster_name)
        if differences and not force:
            refused.append(f"profile {name}: {'; '.join(differences)}")
        elif differences:
            warn(f"profile {name} used as forced, though {'; '.join(differences)}")
        if not isinstance(item, Profile) and VERSION_KEY not in profile.meta:
            warn(f"profile {name} records no tessel version (an older tessel wrote it); profile again")
        if not isinstance(item, Profile) and profile.components and PREFILL_BATCH not in profile.components:
            warn(
                f"profile {name} has no {PREFILL_BATCH} fit (an older tessel wrote it): a pass over several "
                "prompts is priced as paying the layer's intercept once; profile again to time it"
            )
        loaded.append(profile)
    if refused:
        raise TesselError(
            f"{'; '.join(refused)}. Profile this device and model (`tessel profile`), or {FORCE_HINT}"
        )
    return loaded


def warn_profile(message: str) -> None:
    """A yellow warning on stderr (never silent: a forced profile prices the run)."""
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[yellow]warning:[/yellow] {message}")


def _label(item: str | Path | Profile, profile: Profile) -> str:
    if isinstance(item, Profile):
        return f"for {profile.device_type!r:.60} ({profile.dtype})"
    return str(item)


def _scale(profile: Profile) -> int:
    try:
        return int(profile.meta.get("scale", "1"))
    except ValueError:
        return 1


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.strip().split(".")[:2])
