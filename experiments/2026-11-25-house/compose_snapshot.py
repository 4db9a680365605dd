"""Compose the main configs (the bare defaults, every conf/experiment/*.yaml, every group option) and write each
resolved YAML into one folder, so two trees can be compared file by file:

    python experiments/2026-11-25-house/compose_snapshot.py /tmp/before
    ... change conf/ or the schemas ...
    python experiments/2026-11-25-house/compose_snapshot.py /tmp/after && diff -r /tmp/before /tmp/after
"""

import sys
from pathlib import Path

from omegaconf import OmegaConf

from lm.config import compose, conf_dir

SKIP = {"experiment", "hydra"}  # experiments are composed one by one below; hydra/ is Hydra's own


def variants() -> dict[str, list[str]]:
    conf = conf_dir()
    out = {"default": []}
    out |= {
        f"experiment={p.stem}": [f"+experiment={p.stem}"]
        for p in sorted((conf / "experiment").glob("*.yaml"))
    }
    for group in sorted(d for d in conf.iterdir() if d.is_dir() and d.name not in SKIP):
        for p in sorted(group.glob("*.yaml")):
            out[f"{group.name}={p.stem}"] = [f"{group.name}={p.stem}"]
    return out


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, overrides in variants().items():
        try:
            text = OmegaConf.to_yaml(compose(overrides), resolve=True)
        except Exception as e:  # an option that does not compose alone is recorded, not skipped
            text = f"ERROR {type(e).__name__}: {e}\n"
        (out / f"{name}.yaml").write_text(text)
    print(f"{len(variants())} composed configs in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
