"""Open TensorBoard on a run's tb/ folder in a real headless browser and save what a newcomer sees first.

    python experiments/2026-11-28-first-hour/screenshot.py runs/smoke [--priced] [--out DIR]

Needs a Chromium (Debian: `apt-get install chromium-headless-shell`) and Playwright's Python client in any
environment (`pip install playwright`; its own browser download is not needed: `--chromium` points at the
system's). A run writes its layout at start since 2026-11-28 (`lm.store.tensorboard_layout.write_layout`); for
an older run this script writes it into the run's tb/ folder first, as a separate event file (`--no-layout`
skips that, e.g. for a newer run).
Saves custom_scalars.png (the Custom Scalars tab) and time_series.png (TensorBoard's default tab).
"""

import argparse
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"  # the project's environment: TensorBoard and lm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_layout(tb: Path, priced: bool) -> None:
    code = (
        "import sys; from lightning.pytorch.loggers import TensorBoardLogger; "
        "from lm.store.tensorboard_layout import write_layout; "
        "logger = TensorBoardLogger(save_dir=sys.argv[1], name=sys.argv[2], version=''); "
        "write_layout(logger, priced=sys.argv[3] == '1'); logger.experiment.close()"
    )
    subprocess.run([PYTHON, "-c", code, str(tb.parent), tb.name, "1" if priced else "0"], check=True)


def wait_until_up(url: str, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"TensorBoard did not answer at {url} within {seconds} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--priced", action="store_true", help="write the priced layout (cost cards)")
    parser.add_argument("--no-layout", action="store_true", help="do not write the layout (the run did)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument(
        "--chromium", default=shutil.which("chromium-headless-shell") or shutil.which("chromium")
    )
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright  # the browser's client: only this script needs it

    tb = args.run_dir / "tb"
    if not args.no_layout:
        write_layout(tb, args.priced)
    port = free_port()
    server = subprocess.Popen(
        [PYTHON, "-m", "tensorboard.main", "--logdir", str(tb), "--port", str(port), "--host", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_until_up(url)
        args.out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for name, fragment in (("time_series", ""), ("custom_scalars", "#custom_scalars")):
                page.goto(url + fragment, wait_until="networkidle")
                page.wait_for_timeout(4000)  # the charts draw after their data arrives
                page.screenshot(path=str(args.out / f"{name}.png"))
                print(f"wrote {args.out / f'{name}.png'}")
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
