"""Copy one file out of a project's source distribution on PyPI, checked against PyPI's sha256.

    python tests/engines/sdist_file.py vllm 0.33.0 tests/v1/kv_connector/unit/utils.py DEST

./dev engines uses it for vLLM's KV-connector unit-test helpers, which ship only in the sdist.
The sdist is read as a tar file and never built (``pip download`` would try to build it).
Standard library only: it runs under any Python 3.10+.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

PYPI_RELEASE = "https://pypi.org/pypi/{project}/{version}/json"
PYPI_PROJECT = "https://pypi.org/pypi/{project}/json"


class SdistError(Exception):
    """The sdist cannot be found, does not match its sha256, or lacks the file."""


def sdist_url(project: str, version: str) -> tuple[str, str]:
    """The download URL and sha256 of the sdist of ``project==version``, as PyPI's JSON API states them.

    Asks the release's own page first; some PyPI mirrors serve only the project's page, whose
    ``releases`` lists every version (and whose URLs may be relative to the page).
    """
    page = PYPI_RELEASE.format(project=project, version=version)
    try:
        files = _get_json(page)["urls"]
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
        page = PYPI_PROJECT.format(project=project)
        files = _get_json(page)["releases"].get(version, [])
    for entry in files:
        if entry["packagetype"] == "sdist":
            return urllib.parse.urljoin(page, entry["url"]), entry["digests"]["sha256"]
    raise SdistError(f"PyPI lists no sdist for {project}=={version}")


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)


def extract(project: str, version: str, member: str, dest: Path) -> None:
    """Write ``member`` (a path inside the sdist's top folder) to ``dest``; ``dest`` is unchanged on any error."""
    url, sha256 = sdist_url(project, version)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "sdist.tar.gz"
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=300) as r, archive.open("wb") as out:
            while chunk := r.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise SdistError(f"{url}: sha256 {digest.hexdigest()} != {sha256} stated by PyPI")
        with tarfile.open(archive) as tar:
            names = [n for n in tar.getnames() if n.split("/", 1)[-1] == member]
            source = tar.extractfile(names[0]) if names else None
            if source is None:
                raise SdistError(f"{url} holds no file {member}")
            part = dest.with_name(dest.name + ".part")
            part.write_bytes(source.read())
    os.replace(part, dest)


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    project, version, member, dest = argv
    try:
        extract(project, version, member, Path(dest))
    except (SdistError, OSError) as e:
        print(f"sdist_file: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
