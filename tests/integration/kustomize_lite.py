"""The part of kustomize that deploy/k8s uses, for tests on a machine without kubectl or kustomize.

Supported: ``resources`` (files, and folders with a kustomization), ``namespace``, ``images``,
``secretGenerator`` from files with ``generatorOptions.disableNameSuffixHash``, and ``patches`` by
path as strategic merges (maps merge; lists whose items all have a ``name`` merge by it, and
``$patch: delete`` drops one; other lists are replaced). Any other field is refused, so a manifest
that starts using more of kustomize fails here instead of being rendered wrong.
"""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

__all__ = ["render", "pod_templates"]

_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "generatorOptions", "secretGenerator", "patches"}
_CLUSTER_SCOPED = {"Namespace"}
_POD_OWNERS = {"Deployment", "DaemonSet", "StatefulSet"}


def render(folder: Path) -> list[dict]:
    """The objects ``kubectl apply -k folder`` would apply."""
    folder = Path(folder)
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - _FIELDS
    if unknown:
        raise ValueError(f"{folder}/kustomization.yaml uses {sorted(unknown)}, which kustomize_lite does not render; "
                         f"it renders {sorted(_FIELDS)}")
    docs: list[dict] = []
    for entry in k.get("resources", []):
        path = folder / entry
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    if k.get("secretGenerator") and not k.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise ValueError("kustomize_lite renders secretGenerator without name hashes only "
                         "(generatorOptions.disableNameSuffixHash: true)")
    for gen in k.get("secretGenerator", []):
        data = {}
        for entry in gen["files"]:
            key, _, rel = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
            data[key] = base64.b64encode((folder / rel).read_bytes()).decode()
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]},
                     "type": gen.get("type", "Opaque"), "data": data})
    for entry in k.get("patches", []):
        patch = yaml.safe_load((folder / entry["path"]).read_text())
        hits = [i for i, d in enumerate(docs)
                if d["kind"] == patch["kind"] and d["metadata"]["name"] == patch["metadata"]["name"]]
        if len(hits) != 1:
            raise ValueError(f"patch {entry['path']} matches {len(hits)} objects; it must match one")
        docs[hits[0]] = _merge(docs[hits[0]], patch)
    if "namespace" in k:
        for d in docs:
            if d["kind"] not in _CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
    for image in k.get("images", []):
        for _, spec in pod_templates(docs):
            for c in spec["containers"]:
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}".rstrip(":")
    return docs


def pod_templates(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(owner, pod spec) of every object that runs pods."""
    return [(d, d["spec"]["template"]["spec"]) for d in docs if d["kind"] in _POD_OWNERS]


def _merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else value
        return out
    if (isinstance(base, list) and isinstance(patch, list)
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = list(base)
        for item in patch:
            at = next((i for i, x in enumerate(out) if x["name"] == item["name"]), None)
            if item.get("$patch") == "delete":
                if at is None:
                    raise ValueError(f"patch deletes {item['name']!r}, which is not there")
                out.pop(at)
            elif at is None:
                out.append(item)
            else:
                out[at] = _merge(out[at], item)
        return out
    return patch
