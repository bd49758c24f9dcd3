"""An in-memory Hugging Face Hub behind ``httpx2.MockTransport``: only the network layer is fake.

``huggingface_hub`` runs unchanged (HfApi, upload_folder, create_tag, snapshot_download); its
HTTP client is swapped through ``huggingface_hub.utils.set_client_factory`` so every request
lands here. The fake keeps dataset repos with a main branch of commits and tags, and serves the
endpoints those calls use: repo creation, refs, tree listing, preupload, NDJSON commits, tags,
revision info and file resolution.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import httpx2

_API = re.compile(r"^/api/datasets/([^/]+)/([^/]+)/(refs|tree|preupload|commit|tag|revision)(?:/(.*))?$")
_RESOLVE = re.compile(r"^/datasets/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")


@dataclass
class Repo:
    commits: list[tuple[str, dict[str, bytes]]] = field(default_factory=list)   # (oid, files) oldest first
    tags: dict[str, str] = field(default_factory=dict)

    def files_at(self, rev: str) -> tuple[str, dict[str, bytes]] | None:
        if not self.commits:
            return None
        if rev == "main":
            return self.commits[-1]
        oid = self.tags.get(rev, rev)
        return next((c for c in self.commits if c[0] == oid), None)


class FakeHub:
    """State plus a request handler; ``requests`` logs (method, path) of every call."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []

    def transport(self) -> httpx2.MockTransport:
        return httpx2.MockTransport(self.handle)

    def handle(self, req: httpx2.Request) -> httpx2.Response:
        path = req.url.path
        self.requests.append((req.method, path))
        if path == "/api/agent-harnesses":
            return httpx2.Response(200, json={"standardEnvVars": [], "harnesses": {}})
        if path == "/api/repos/create" and req.method == "POST":
            body = json.loads(req.content)
            repo_id = f"{body['organization']}/{body['name']}"
            if repo_id in self.repos:
                return httpx2.Response(409, json={"error": "You already created this dataset repo",
                                                  "url": f"https://huggingface.co/datasets/{repo_id}"})
            self.repos[repo_id] = Repo()
            return httpx2.Response(200, json={"url": f"https://huggingface.co/datasets/{repo_id}"})
        if path == "/api/validate-yaml" and req.method == "POST":
            return self._validate_yaml(json.loads(req.content)["content"])
        m = _API.match(path)
        if m:
            repo_id, what, rest = f"{m.group(1)}/{m.group(2)}", m.group(3), m.group(4) or ""
            repo = self.repos.get(repo_id)
            if repo is None:
                return httpx2.Response(404, headers={"X-Error-Code": "RepoNotFound"},
                                       json={"error": "Repository not found"})
            return getattr(self, f"_{what}")(req, repo, rest, repo_id)
        m = _RESOLVE.match(path)
        if m:
            repo = self.repos.get(f"{m.group(1)}/{m.group(2)}")
            snap = repo.files_at(m.group(3)) if repo else None
            if snap is None or m.group(4) not in snap[1]:
                return httpx2.Response(404, headers={"X-Error-Code": "EntryNotFound"}, json={"error": "not found"})
            data = snap[1][m.group(4)]
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": snap[0],
                       "Content-Length": str(len(data))}
            return httpx2.Response(200, headers=headers, content=b"" if req.method == "HEAD" else data)
        return httpx2.Response(404, json={"error": f"fake hub has no route for {req.method} {path}"})

    # -- endpoints -------------------------------------------------------------------------
    def _validate_yaml(self, content: str) -> httpx2.Response:
        """The card's front matter must parse and declare configs with data_files (like the Hub's check)."""
        import yaml

        errors = []
        if content.startswith("---\n") and "\n---\n" in content[4:]:
            try:
                meta = yaml.safe_load(content[4:content.index("\n---\n", 4)])
            except yaml.YAMLError as e:
                meta, errors = None, [f"invalid YAML: {e}"]
            if isinstance(meta, dict):
                for c in meta.get("configs", []):
                    if not isinstance(c, dict) or "config_name" not in c or "data_files" not in c:
                        errors.append(f"bad configs entry {c!r}")
        if errors:
            return httpx2.Response(400, json={"errors": [{"message": m} for m in errors]})
        return httpx2.Response(200, json={"errors": [], "warnings": []})

    def _refs(self, req: httpx2.Request, repo: Repo, rest: str, repo_id: str) -> httpx2.Response:
        head = repo.commits[-1][0] if repo.commits else "0" * 40
        return httpx2.Response(200, json={
            "branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": head}],
            "converts": [],
            "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": oid} for t, oid in repo.tags.items()],
        })

    def _tree(self, req: httpx2.Request, repo: Repo, rest: str, repo_id: str) -> httpx2.Response:
        """``tree/<rev>[/<folder>]``: the folder's files and sub-folders (all below it with ``recursive``)."""
        rev, _, folder = rest.partition("/")
        snap = repo.files_at(rev or "main")
        files = snap[1] if snap else {}
        recursive = req.url.params.get("recursive") in ("true", "True", "1")
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        out: dict[str, dict] = {}
        for p, b in sorted(files.items()):
            if not p.startswith(prefix):
                continue
            parts = p[len(prefix):].split("/")
            for depth in range(1, len(parts)):
                d = prefix + "/".join(parts[:depth])
                if recursive or depth == 1:
                    out.setdefault(d, {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()})
            if recursive or len(parts) == 1:
                out[p] = {"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
        return httpx2.Response(200, json=[out[k] for k in sorted(out)])

    def _preupload(self, req: httpx2.Request, repo: Repo, rest: str, repo_id: str) -> httpx2.Response:
        files = json.loads(req.content)["files"]
        return httpx2.Response(200, json={"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                    for f in files]})

    def _commit(self, req: httpx2.Request, repo: Repo, rest: str, repo_id: str) -> httpx2.Response:
        files = dict(repo.commits[-1][1]) if repo.commits else {}
        for line in req.content.decode().splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                files = {p: b for p, b in files.items() if p != value["path"] and not p.startswith(value["path"] + "/")}
            elif key == "lfsFile":
                return httpx2.Response(400, json={"error": "the fake hub takes regular uploads only"})
        oid = hashlib.sha1(json.dumps(sorted((p, hashlib.sha256(b).hexdigest()) for p, b in files.items())).encode()
                           + str(len(repo.commits)).encode()).hexdigest()
        repo.commits.append((oid, files))
        return httpx2.Response(200, json={"success": True, "commitOid": oid,
                                          "commitUrl": f"https://huggingface.co/datasets/{repo_id}/commit/{oid}"})

    def _tag(self, req: httpx2.Request, repo: Repo, rest: str, repo_id: str) -> httpx2.Response:
        body: dict[str, Any] = json.loads(req.content)
        if body["tag"] in repo.tags:
            return httpx2.Response(409, json={"error": "Tag already exists"})
        snap = repo.files_at(rest)
        if snap is None:
            return httpx2.Response(404, headers={"X-Error-Code": "RevisionNotFound"}, json={"error": "no revision"})
        repo.tags[body["tag"]] = snap[0]
        return httpx2.Response(200, json={})

    def _revision(self, req: httpx2.Request, repo: Repo, rest: str, repo_id: str) -> httpx2.Response:
        snap = repo.files_at(rest)
        if snap is None:
            return httpx2.Response(404, headers={"X-Error-Code": "RevisionNotFound"}, json={"error": "Invalid rev id"})
        return httpx2.Response(200, json={"id": repo_id, "sha": snap[0], "private": False,
                                          "siblings": [{"rfilename": p} for p in sorted(snap[1])]})
