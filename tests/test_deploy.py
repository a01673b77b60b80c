"""deploy/ must stay true to the code: files parse, commands parse with the real CLI parser, ports,
grace periods, schema names and metric names agree, alert rules pass promtool, and the roles in
deploy/sql/roles.sql grant exactly what producers and workers need (checked on a real database)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from conftest import ThreadWorker, dashboard_exprs, states, wait_until
from opentelemetry.sdk.trace import TracerProvider
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import worker
from worker.cli import build_parser
from worker.contrib import otel
from worker.engine.loop import WorkerConfig
from worker.monitor.metrics.instruments import DATABASE_METRICS, WORKER_METRICS, exported_series
from worker.tasks.registry import Registry

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
METRIC = re.compile(r"\bworker_[a-z0-9_]+")


def load_yaml(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        doc
        for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
        for doc in load_yaml(path)
        if doc.get("kind") == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def compose() -> dict[str, Any]:
    return load_yaml(DEPLOY / "docker-compose.yml")[0]


def systemd_command() -> list[str]:
    text = (DEPLOY / "systemd" / "worker.service").read_text()
    line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert Path(argv[0]).name == "worker"
    return argv[1:]


def systemd_setting(name: str) -> str:
    text = (DEPLOY / "systemd" / "worker.service").read_text()
    return next(x.split("=", 1)[1] for x in text.splitlines() if x.startswith(f"{name}="))


def dockerfile_cmd() -> list[str]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("CMD "))
    return json.loads(line.removeprefix("CMD "))


def dockerfile_instructions() -> list[str]:
    """The Dockerfile's instructions, each on one line (continuations joined, comments out)."""
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [x for x in text.splitlines() if not x.lstrip().startswith("#")]
    return [x.strip() for x in "\n".join(lines).replace("\\\n", " ").splitlines() if x.strip()]


def deployment_container() -> dict[str, Any]:
    return k8s("Deployment", "worker")["spec"]["template"]["spec"]["containers"][0]


def run_commands() -> dict[str, list[str]]:
    """Every `worker run` command line in deploy/, by where it comes from."""
    return {
        "compose worker": [str(a) for a in compose()["services"]["worker"]["command"]],
        "k8s deployment": [str(a) for a in deployment_container()["args"]],
        "systemd": systemd_command(),
        "Dockerfile CMD": dockerfile_cmd(),
    }


def option(argv: list[str], flag: str) -> str:
    args = build_parser().parse_args(argv)
    return getattr(args, flag.lstrip("-").replace("-", "_"))


# -- syntax ----------------------------------------------------------------------------------------


def test_every_yaml_and_json_file_parses() -> None:
    files = [p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml", ".json")]
    assert len(files) >= 10
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert load_yaml(path), f"{path} is empty"


def test_commands_parse_with_the_real_cli() -> None:
    """Each command line goes through worker's own parser, so a renamed or removed flag (or a
    bad value) fails here rather than in a crash-looping pod."""
    commands = dict(run_commands())
    commands["compose migrate"] = [str(a) for a in compose()["services"]["migrate"]["command"]]
    commands["k8s migrate job"] = [
        str(a)
        for a in k8s("Job", "worker-migrate")["spec"]["template"]["spec"]["containers"][0]["args"]
    ]
    for where, argv in commands.items():
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `worker {' '.join(argv)}` does not parse")
        assert args.command in ("run", "migrate"), where


# -- ports, hosts, grace, schema -------------------------------------------------------------------


def test_metrics_port_is_the_same_everywhere() -> None:
    ports = {where: option(argv, "--metrics-port") for where, argv in run_commands().items()}
    assert len(set(ports.values())) == 1, ports
    port = next(iter(ports.values()))
    for where, argv in run_commands().items():
        assert option(argv, "--metrics-host") == "0.0.0.0", f"{where} must listen beyond loopback"

    svc = compose()["services"]["worker"]
    assert [int(p) for p in svc["expose"]] == [port]
    assert f"127.0.0.1:{port}/readyz" in " ".join(svc["healthcheck"]["test"])
    assert "ports" not in svc, "a published host port would stop --scale worker=N"

    prom = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")[0]
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "worker")
    assert job["dns_sd_configs"][0]["port"] == port
    assert job["dns_sd_configs"][0]["names"] == ["worker"]  # the compose service name

    container = deployment_container()
    metrics_port = next(p for p in container["ports"] if p["name"] == "metrics")
    assert metrics_port["containerPort"] == port
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ("metrics", port)
    annotations = k8s("Deployment", "worker")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port
    service = k8s("Service", "worker-metrics")
    assert service["spec"]["ports"][0]["port"] == port

    assert re.search(rf"^EXPOSE {port}$", (DEPLOY / "Dockerfile").read_text(), re.M)


@pytest.mark.parametrize(
    ("host", "said"),
    [
        (
            "0.0.0.0",
            "on 0.0.0.0:{port}, every IPv4 address of this machine"
            " (http://127.0.0.1:{port}/ from it)",
        ),
        ("127.0.0.1", "on 127.0.0.1:{port} (http://127.0.0.1:{port}/)"),
        ("::1", "on [::1]:{port} (http://[::1]:{port}/)"),
    ],
    ids=["every-ipv4-address", "loopback", "ipv6-loopback"],
)
def test_the_start_up_line_says_what_the_server_binds(
    host: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Containers bind 0.0.0.0: the line says so (it said http://127.0.0.1:9470/ before), and
    where to open it from the machine itself."""
    import socket

    from worker.monitor.server import serve

    if ":" in host and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    caplog.set_level("INFO", logger="worker.metrics")
    try:
        server = serve(host, 0, dsn="postgresql://u:pw@127.0.0.1:1/db", schema="worker", ttl=0)
    except Exception as exc:  # an IPv6 loopback that cannot be bound
        if ":" in host:
            pytest.skip(f"cannot bind {host}: {exc}")
        raise
    try:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving")]
        assert len(lines) == 1 and lines[0].endswith(said.format(port=server.port)), lines
    finally:
        server.stop()


def test_probes_use_the_health_endpoints() -> None:
    container = deployment_container()
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_stop_timeouts_outlast_the_grace_period() -> None:
    """The supervisor needs --grace plus 5 s to stop its children; every orchestrator must wait
    longer than that before it kills."""
    margin = 5
    grace = {where: option(argv, "--grace") for where, argv in run_commands().items()}
    spec = k8s("Deployment", "worker")["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > grace["k8s deployment"] + margin
    compose_stop = compose()["services"]["worker"]["stop_grace_period"]
    assert int(compose_stop.removesuffix("s")) > grace["compose worker"] + margin
    assert int(systemd_setting("TimeoutStopSec")) > grace["systemd"] + margin
    # Only the supervisor may get systemd's SIGTERM: a second one stops a worker at once.
    assert systemd_setting("KillMode") == "mixed"


def test_processes_are_set_explicitly_in_containers() -> None:
    """The default (one per CPU) counts the host's CPUs inside a container."""
    for where in ("compose worker", "k8s deployment", "Dockerfile CMD"):
        assert option(run_commands()[where], "--processes"), where


def test_schema_name_agrees_with_keda_and_the_job() -> None:
    schema = option(run_commands()["k8s deployment"], "--schema")
    job = k8s("Job", "worker-migrate")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert option([str(a) for a in job], "--schema") == schema
    query = k8s("ScaledObject", "worker")["spec"]["triggers"][0]["metadata"]["query"]
    assert f" {schema}.tasks" in query


def test_keda_scales_the_deployment_on_due_tasks(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """The scaler's query runs on a real table and counts due queued tasks, capped at what the
    maximum replica count could use."""
    obj = k8s("ScaledObject", "worker")
    assert obj["spec"]["scaleTargetRef"]["name"] == k8s("Deployment", "worker")["metadata"]["name"]
    trigger = obj["spec"]["triggers"][0]
    assert trigger["type"] == "postgresql"
    auth = k8s("TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} <= {"connection", "password"}
    meta = trigger["metadata"]
    target, most = int(meta["targetQueryValue"]), int(obj["spec"]["maxReplicaCount"])
    limit = int(re.search(r"LIMIT (\d+)", meta["query"]).group(1))
    assert limit == target * most
    assert obj["spec"]["minReplicaCount"] >= 1

    query = meta["query"].replace("worker.tasks", f"{schema}.tasks")
    conn.execute(f"INSERT INTO {schema}.tasks (task) SELECT 'a' FROM generate_series(1, 7)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, run_at) VALUES ('later', now() + interval '1 hour')"
    )
    conn.execute(f"INSERT INTO {schema}.tasks (task, state) VALUES ('x', 'done')")
    assert conn.execute(query).fetchone()[0] == 7


def test_pdb_and_service_select_the_worker_pods() -> None:
    labels = k8s("Deployment", "worker")["spec"]["template"]["metadata"]["labels"]
    for selector in (
        k8s("PodDisruptionBudget", "worker")["spec"]["selector"]["matchLabels"],
        k8s("Service", "worker-metrics")["spec"]["selector"],
        k8s("Deployment", "worker")["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()


def test_containers_run_as_non_root() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.12-slim$", text, re.M)
    assert "pip install /tmp/src" in text
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    spec = k8s("Deployment", "worker")["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert deployment_container()["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in deployment_container()["volumeMounts"]}
    assert "/tmp" in mounts  # the multiprocess metrics and liveness files live there


# -- metric names ----------------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    doc = load_yaml(DEPLOY / "prometheus" / "alerts.yml")[0]
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_dashboard_and_alerts_only_use_metrics_the_code_exports() -> None:
    known = exported_series()
    used: dict[str, set[str]] = {"dashboard": set(), "alerts": set()}
    for expr in dashboard_exprs():
        used["dashboard"] |= set(METRIC.findall(expr))
    for rule in alert_rules():
        used["alerts"] |= set(METRIC.findall(rule["expr"]))
        # Annotations may name a histogram by its family name.
        mentioned = set(METRIC.findall(" ".join(rule.get("annotations", {}).values())))
        families = known | set(WORKER_METRICS) | set(DATABASE_METRICS)
        assert mentioned <= families, f"{rule['alert']} mentions {mentioned - families}"
    for where, names in used.items():
        assert names, where
        assert names <= known, f"{where} uses metrics the code does not export: {names - known}"
    # And the dashboard covers what operators look at first.
    for needed in (
        "worker_tasks_completed_total",
        "worker_tasks_failed_total",
        "worker_task_latency_seconds_bucket",
        "worker_queue_tasks",
        "worker_queue_oldest_task_age_seconds",
    ):
        assert needed in used["dashboard"], needed


def test_alerts_cover_the_failure_modes_and_the_scrape_job() -> None:
    names = {r["alert"] for r in alert_rules()}
    assert {
        "WorkerQueueGrowing",
        "WorkerOldestTaskTooOld",
        "WorkerHighFailureRate",
        "WorkerNoneAlive",
    } <= names
    prom = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")[0]
    jobs = {j["job_name"] for j in prom["scrape_configs"]}
    for rule in alert_rules():
        for job in re.findall(r'job="([^"]+)"', rule["expr"]):
            assert job in jobs, f"{rule['alert']} refers to scrape job {job!r}"
    assert prom["rule_files"] == ["alerts.yml"]
    assert (
        "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro"
        in (compose()["services"]["prometheus"]["volumes"])
    )


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    ds = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")[0]
    uid = ds["datasources"][0]["uid"]
    board = json.loads((DEPLOY / "grafana" / "dashboards" / "worker.json").read_text())
    uids = {p["datasource"]["uid"] for p in board["panels"] if "datasource" in p}
    assert uids == {uid}
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "worker.yml")[0]
    path = provider["providers"][0]["options"]["path"]
    assert f"./grafana/dashboards:{path}:ro" in compose()["services"]["grafana"]["volumes"]


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian: apt-get install -y prometheus)",
)


def promtool(*args: str, cwd: Path = DEPLOY / "prometheus") -> None:
    assert PROMTOOL
    r = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_alert_rules_pass_promtool() -> None:
    promtool("check", "rules", "alerts.yml")
    promtool("test", "rules", "alerts_test.yml")
    promtool("check", "config", "prometheus.yml")


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Grafana's variables replaced by plain values, each panel query becomes a recording rule,
    which promtool parses."""
    rules = [
        {
            "record": f"dashboard:query{i}",
            "expr": e.replace("$__rate_interval", "5m").replace("$queue", ".*"),
        }
        for i, e in enumerate(dashboard_exprs())
        if not e.startswith("label_values(")
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool("check", "rules", str(path), cwd=tmp_path)


# -- roles.sql on a real database ------------------------------------------------------------------


def _psql() -> str | None:
    try:
        from worker.dev.embedded import find_pg_bin

        candidate = Path(find_pg_bin()) / "psql"
        if candidate.exists():
            return str(candidate)
    except Exception:
        pass
    return shutil.which("psql")


@pytest.fixture
def roles(pg_dsn: str, schema: str, conn: psycopg.Connection) -> Iterator[dict[str, str]]:
    """deploy/sql/roles.sql applied (twice: it must be re-runnable) to the test schema, with role
    names of this test; the roles are dropped afterwards (they are cluster-wide)."""
    psql = _psql()
    if psql is None:
        pytest.skip("psql not found (it comes with the pgserver wheel or a PostgreSQL client)")
    names = {
        "producer": f"{schema}_producer",
        "worker": f"{schema}_runner",
        "login": f"{schema}_login",
    }
    cmd = [
        psql, pg_dsn, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-v", f"schema={schema}",
        "-v", f"producer_role={names['producer']}", "-v", f"worker_role={names['worker']}",
        "-f", str(DEPLOY / "sql" / "roles.sql"),
    ]  # fmt: skip
    try:
        for _ in range(2):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if "permission denied to create role" in r.stderr:
                pytest.skip("the test database user cannot create roles")
            assert r.returncode == 0, r.stderr
        yield names
    finally:
        for role in names.values():
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def as_role(conn: psycopg.Connection, role: str, statement: str) -> list[Any]:
    """Run one statement as ``role`` (SET LOCAL ROLE: the role ends with the transaction)."""
    with conn.transaction():
        conn.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(role)))
        cur = conn.execute(statement)
        return cur.fetchall() if cur.description else []


def denied(conn: psycopg.Connection, role: str, statement: str) -> bool:
    try:
        as_role(conn, role, statement)
    except errors.InsufficientPrivilege:
        return True
    return False


def test_producer_role_can_enqueue_and_nothing_else(
    roles: dict[str, str], schema: str, conn: psycopg.Connection
) -> None:
    p = roles["producer"]
    first = as_role(conn, p, f"SELECT {schema}.enqueue('send', dedupe_key => 'k1')")[0][0]
    again = as_role(conn, p, f"SELECT {schema}.enqueue('send', dedupe_key => 'k1')")[0][0]
    assert first == again  # the dedupe lookup works with the producer's rights
    as_role(conn, p, f"INSERT INTO {schema}.tasks (task, payload, queue) VALUES ('b', '{{}}', 'q')")
    with conn.transaction():
        conn.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(p)))
        worker.enqueue_many(conn, "bulk", ({"i": i} for i in range(20)), schema=schema)
    assert conn.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()[0] == 22
    # With tracing on (worker.contrib.otel) both paths also write trace_context.
    otel.instrument(TracerProvider())
    try:
        with conn.transaction():
            conn.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(p)))
            worker.enqueue(conn, "traced", schema=schema)
            worker.enqueue_many(conn, "traced", [{}, {}], schema=schema)
    finally:
        otel.uninstrument()
    assert conn.execute(f"SELECT count(trace_context) FROM {schema}.tasks").fetchone()[0] == 3

    for statement in (
        f"UPDATE {schema}.tasks SET priority = 5",
        f"DELETE FROM {schema}.tasks",
        f"SELECT payload FROM {schema}.tasks",
        f"INSERT INTO {schema}.tasks (task, state) VALUES ('forged', 'done')",
        f"INSERT INTO {schema}.tasks (task, worker_id) VALUES ('forged', gen_random_uuid())",
        f"TRUNCATE {schema}.tasks",
        f"SELECT * FROM {schema}.workers",
        f"SELECT * FROM {schema}.schema_migrations",
        f"DROP TABLE {schema}.tasks",
        f"SELECT {schema}.cancel_task(1)",
    ):
        assert denied(conn, p, statement), statement


def test_worker_role_runs_a_worker_but_cannot_change_the_schema(
    roles: dict[str, str], pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A login in the worker role runs a real Worker (claims, retries, completes, registers,
    heartbeats), reads the status page, and cannot migrate, drop or truncate."""
    login, runner = roles["login"], roles["worker"]
    conn.execute(
        sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
            sql.Identifier(login), sql.Identifier(runner)
        )
    )
    dsn = make_conninfo(**{**conninfo_to_dict(pg_dsn), "user": login, "password": None})
    try:
        psycopg.connect(dsn, connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        pytest.skip(f"cannot log in as a new role on the test database: {exc}")

    reg = Registry()
    queue = f"roles_{uuid.uuid4().hex[:6]}"

    @reg.task("roles.ok", queue=queue)
    def ok(payload: dict) -> None:
        pass

    @reg.task("roles.bad", queue=queue, max_attempts=2, retry_backoff=0)
    def bad(payload: dict) -> None:
        raise ValueError("nope")

    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, max_attempts) VALUES"
        " ('roles.ok', %s, 3), ('roles.ok', %s, 3), ('roles.bad', %s, 2)",
        (queue, queue, queue),
    )
    config = WorkerConfig(
        dsn=dsn, schema=schema, queues=[queue], poll_interval=0.1, lease_seconds=2,
        keep_history=True,
    )  # fmt: skip
    with ThreadWorker(config, reg) as tw:
        # The done rows moved to the history (the failed one stays).
        wait_until(
            lambda: (
                states(conn, schema) == {"failed": 1}
                and conn.execute(
                    f"SELECT count(*) FROM {schema}.task_rows WHERE state = 'done'"
                ).fetchone()[0]
                == 2
            )
        )
        tw.stop()
    # The history's retention empties their slot whole.
    with psycopg.connect(dsn, autocommit=True) as w:
        w.execute(f"SELECT {schema}.rotate_history(0, 0)")  # the slot closes
        time.sleep(0.01)
        emptied = w.execute(f"SELECT {schema}.rotate_history(0, 0)").fetchone()
    assert emptied == (1,)

    from test_metrics import fetch

    from worker.monitor.server import serve

    server = serve("127.0.0.1", 0, dsn=dsn, schema=schema, ttl=0)
    try:
        assert fetch(server.url)[0] == 200
        assert fetch(server.url + "readyz")[0] == 200
        assert "worker_database_up 1.0" in fetch(server.url + "metrics")[1]
    finally:
        server.stop()

    for statement in (
        f"INSERT INTO {schema}.schema_migrations (version, name) VALUES (999, 'x')",
        f"UPDATE {schema}.schema_migrations SET name = 'x'",
        f"DROP TABLE {schema}.tasks",
        f"TRUNCATE {schema}.tasks",
        f"ALTER TABLE {schema}.tasks ADD COLUMN x int",
        f"CREATE TABLE {schema}.mine (x int)",
    ):
        assert denied(conn, runner, statement), statement


def test_each_role_runs_its_cli_commands_end_to_end_and_is_refused_the_others(
    roles: dict[str, str], pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Log in as a member of each role of roles.sql and use the real `worker` commands: the
    producer enqueues with `worker enqueue` and `worker.enqueue()`, and is refused `status`,
    `run` and `migrate` with one line each; the runner reads `status` and is refused `migrate`."""
    from conftest import run_cli

    logins = {}
    for kind in ("producer", "worker"):
        login = f"{roles[kind]}_in"
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                sql.Identifier(login), sql.Identifier(roles[kind])
            )
        )
        logins[kind] = make_conninfo(
            **{**conninfo_to_dict(pg_dsn), "user": login, "password": None}
        )
    try:
        try:
            psycopg.connect(logins["producer"], connect_timeout=5).close()
        except psycopg.OperationalError as exc:
            pytest.skip(f"cannot log in as a new role on the test database: {exc}")

        def cli(kind: str, *args: str) -> subprocess.CompletedProcess[str]:
            return run_cli(*args, "--schema", schema, env={"WORKER_DSN": logins[kind]})

        r = cli("producer", "enqueue", "roles.cli", "--payload", '{"n": 1}')
        assert r.returncode == 0, r.stderr
        task_id = int(r.stdout.strip())
        assert worker.enqueue(logins["producer"], "roles.py", {"n": 2}, schema=schema) > task_id
        assert conn.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()[0] == 2

        for args in (("status",), ("migrate",), ("run", "tasks_module", "--processes", "1")):
            r = cli("producer", *args)
            assert r.returncode != 0, (args, r.stdout)
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and "permission denied" in lines[0], (args, r.stderr)

        r = cli("worker", "status", "--json")
        assert r.returncode == 0, r.stderr
        assert sum(q["counts"]["queued"] for q in json.loads(r.stdout)["queues"]) == 2
        r = cli("worker", "migrate")
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1, r.stderr
    finally:
        for login in (f"{roles[k]}_in" for k in ("producer", "worker")):
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (login,)).fetchone():
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(login)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(login)))


# -- installs without the embedded extra -----------------------------------------------------------
#
# The pgserver wheel (34 MB of PostgreSQL binaries) is the `embedded` extra: `worker demo` and every
# command without a DSN need it (or a PostgreSQL on the machine); a production install, the image
# included, does not.

NO_EMBEDDED = """\
# Made by tests/test_deploy.py: this interpreter as if neither the `embedded` extra nor a
# PostgreSQL of the machine's own were installed.
import glob
import sys
import time

sys.modules["pgserver"] = None  # `import pgserver` raises ImportError, find_spec finds nothing
_glob = glob.glob
glob.glob = lambda pattern, *a, **k: [] if "postgresql" in pattern else _glob(pattern, *a, **k)
"""
MISSING = (
    "the embedded PostgreSQL is not installed: pip install 'worker-pg[embedded]' (or set "
    "WORKER_PG_BIN to a PostgreSQL bin folder), or set WORKER_DSN to use a server of yours"
)


def pyproject() -> dict[str, Any]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_embedded_server_is_an_extra_that_the_image_leaves_out() -> None:
    project = pyproject()["project"]
    assert not [d for d in project["dependencies"] if d.startswith("pgserver")]
    extras = project["optional-dependencies"]
    assert [d.split(";")[0] for d in extras["embedded"]] == ["pgserver>=0.1.4"]
    # The suite starts embedded servers: the test extra has the same requirement, on the
    # Pythons the wheel is built for (none yet for 3.13, where those tests are not run).
    assert "pgserver>=0.1.4" in [d.split(";")[0] for d in extras["test"]]
    # The README's first command installs it; the image's install does not.
    readme = (ROOT / "README.md").read_text()
    assert (
        "python3 -m venv .venv && .venv/bin/pip install -e '.[embedded]' && .venv/bin/worker demo"
        in readme
    )
    runs = [i for i in dockerfile_instructions() if i.startswith("RUN ")]
    installs = [x for run in runs for x in re.findall(r"pip install (\S+)", run)]
    assert installs == ["/tmp/src"], installs


def test_every_install_line_names_the_distribution() -> None:
    """`pip install worker` fetches an unrelated project (no `worker` command): deploy/ and the
    docs install `worker-pg`, or a path, or the clone."""
    files = [*DEPLOY.rglob("*"), ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    seen = 0
    for path in files:
        if not path.is_file() or path.suffix in (".json", ".png"):
            continue
        for line in path.read_text().splitlines():
            for target in re.findall(r"pip install (?:-\S+ )*(['\"]?[\w./~-][^\s`'\"]*)", line):
                seen += 1
                target = target.strip("'\"")
                name = re.split(r"[\[<>=]", target)[0]
                assert name != "worker", f"{path}: {line}"
                assert name == "worker-pg" or name.startswith(("/", ".", "~", "dist/worker_pg-")), (
                    f"{path}: {line}"
                )
    assert seen >= 10


@pytest.fixture
def without_embedded(tmp_path: Path) -> dict[str, str]:
    """The environment of a `worker` process that cannot find pgserver nor any PostgreSQL
    binaries, with an empty embedded data folder of its own and no DSN."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(NO_EMBEDDED)
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("WORKER_PG_BIN", "DATABASE_URL")}
    return {
        **env,
        "WORKER_DSN": "",
        "PYTHONPATH": f"{shim}{os.pathsep}{ROOT / 'tests'}",
        "PATH": str(empty),
        "WORKER_EMBEDDED_DIR": str(tmp_path / "pgdata"),
    }


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.db  # runs worker commands
def test_without_the_extra_the_embedded_commands_name_it(
    without_embedded: dict[str, str],
) -> None:
    """Each command that would start the embedded server says, in one line and with exit 2,
    which extra to install; nothing is created."""
    probe = subprocess.run(
        [sys.executable, "-c", "import pgserver"], env=without_embedded, capture_output=True
    )
    assert probe.returncode == 1 and b"ModuleNotFoundError" in probe.stderr  # the shim works
    for args in (
        ("demo", "--tasks", "10"),
        ("migrate",),
        ("enqueue", "job"),
        ("run", "tasks_module", "--processes", "1"),
        ("dsn",),
        ("embedded", "start"),
    ):
        r = cli(without_embedded, *args)
        expected = (
            MISSING
            if args[0] == "embedded"
            else (f"no DSN given (--dsn, WORKER_DSN or DATABASE_URL), and {MISSING}")
        )
        assert (r.returncode, r.stdout, r.stderr) == (2, "", f"worker: error: {expected}\n"), args
    assert not Path(without_embedded["WORKER_EMBEDDED_DIR"]).exists()
    r = cli(without_embedded, "embedded", "status")  # as `systemctl status`: 1 when stopped
    assert r.returncode == 1 and r.stdout.startswith("stopped: "), r.stderr
    r = cli(without_embedded, "status")  # read-only: no server, the same line as ever
    assert r.returncode == 4 and "is not running" in r.stderr


def test_without_the_extra_a_worker_with_a_dsn_works(
    without_embedded: dict[str, str], pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A production install: migrate, enqueue, run and status against a DSN, as the image runs
    them, never look for the embedded server."""
    env = {**without_embedded, "WORKER_DSN": pg_dsn, "WORKER_SCHEMA": schema}
    for args in (
        ("migrate",),
        ("enqueue", "noop", "--payload", "{}"),
        ("run", "tasks_module", "--processes", "1", "--burst"),
        ("status", "--json"),
    ):
        r = cli(env, *args)
        assert r.returncode == 0, (args, r.stderr)
        assert "embedded" not in r.stderr, r.stderr
    assert states(conn, schema) == {"done": 1}


# -- the image's user ------------------------------------------------------------------------------


def dockerfile_user_commands() -> list[list[str]]:
    """The groupadd and useradd commands of the Dockerfile's RUN lines, in their order."""
    found = []
    for run in (i.removeprefix("RUN ") for i in dockerfile_instructions() if i.startswith("RUN ")):
        for part in run.split("&&"):
            argv = shlex.split(part)
            if argv and argv[0] in ("groupadd", "useradd"):
                found.append(argv)
    return found


def test_the_image_user_has_a_group_of_its_own() -> None:
    """`USER 10001:10001` names a user and a group that exist: the group is made first with gid
    10001 (useradd --user-group would take one from the system range, 999), then the user in it."""
    (groupadd, group_flags), (useradd, user_flags) = [
        (argv[0], argv[1:]) for argv in dockerfile_user_commands()
    ]
    assert (groupadd, useradd) == ("groupadd", "useradd")
    assert " ".join(group_flags) == "--system --gid 10001 worker"
    joined = " ".join(user_flags)
    assert "--uid 10001 --gid 10001" in joined and user_flags[-1] == "worker"
    assert "--user-group" not in user_flags and "-U" not in user_flags
    assert "-K SYS_UID_MAX=10001" in joined  # no "uid 10001 is greater than SYS_UID_MAX" warning
    assert "--no-log-init" in user_flags
    users = re.findall(r"^USER (\S+)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert users == ["10001:10001"]


ROOT_TOOLS = shutil.which("groupadd") and shutil.which("useradd")


@pytest.mark.skipif(
    not ROOT_TOOLS or os.geteuid() != 0,
    reason="runs the Dockerfile's groupadd/useradd in a scratch root: needs root and the shadow "
    "tools (Debian: passwd), as the image's build does",
)
def test_the_image_user_commands_run_cleanly(tmp_path: Path) -> None:
    """The Dockerfile's own groupadd and useradd, run with --root in a scratch copy of this
    machine's account files (Debian bookworm, as python:3.12-slim): no warning, and the entries
    `USER 10001:10001` resolves to."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for name in ("passwd", "group", "shadow", "gshadow", "login.defs"):
        if Path("/etc", name).exists():
            shutil.copy(Path("/etc", name), root / "etc" / name)
    for folder in ("default", "skel"):
        if Path("/etc", folder).is_dir():
            shutil.copytree(Path("/etc", folder), root / "etc" / folder)
    nologin = root / "usr" / "sbin" / "nologin"  # the image has it; useradd checks the shell
    nologin.parent.mkdir(parents=True)
    nologin.write_text("#!/bin/sh\nexit 1\n")
    nologin.chmod(0o755)
    for argv in dockerfile_user_commands():
        r = subprocess.run(
            [argv[0], "--root", str(root), *argv[1:]], capture_output=True, text=True, timeout=60
        )
        assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), argv
    passwd = (root / "etc" / "passwd").read_text().splitlines()
    group = (root / "etc" / "group").read_text().splitlines()
    assert "worker:x:10001:10001::/app:/usr/sbin/nologin" in passwd
    assert "worker:x:10001:" in group
    assert (root / "app").stat().st_uid == 10001 and (root / "app").stat().st_gid == 10001


def test_the_build_context_is_kept_small_by_a_root_dockerignore() -> None:
    """docker-compose 1.x and `DOCKER_BUILDKIT=0 docker build` read only the context root's
    .dockerignore: it leaves everything out but the sources the COPY lines name."""
    assert not (DEPLOY / "Dockerfile.dockerignore").exists()  # one list, not two that drift
    patterns = [
        x.strip()
        for x in (ROOT / ".dockerignore").read_text().splitlines()
        if x.strip() and not x.startswith("#")
    ]
    assert patterns[0] == "**"
    kept = {p.removeprefix("!").removesuffix("/**") for p in patterns if p.startswith("!")}
    sources = set()
    for copy in (i for i in dockerfile_instructions() if i.startswith("COPY ")):
        args = [a for a in copy.split()[1:] if not a.startswith("--")]
        sources |= set(args[:-1])
    assert kept == sources, (kept, sources)
    for heavy in (".git", ".venv", "tests", "docs", "deploy"):
        assert heavy not in kept
    compose_build = compose()["services"]["migrate"]["build"]
    assert (compose_build["context"], compose_build["dockerfile"]) == ("..", "deploy/Dockerfile")


# -- the systemd unit ------------------------------------------------------------------------------

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze is not installed (Debian: apt-get install systemd)",
)
# `systemd-analyze security` of the unit: 6.2 MEDIUM before the hardening, 1.4 OK with it.
EXPOSURE_LIMIT = 2.0


def unit_root(tmp_path: Path, text: str | None = None) -> Path:
    """A scratch root holding the unit as installed (its ExecStart and EnvironmentFile present)
    and the system's targets and slices, for systemd-analyze --root."""
    root = tmp_path / "root"
    units = root / "usr" / "lib" / "systemd" / "system"
    units.mkdir(parents=True)
    for path in Path("/usr/lib/systemd/system").glob("*"):
        if path.suffix in (".target", ".slice") and path.is_file() and not path.is_symlink():
            shutil.copy(path, units / path.name)
    unit = root / "etc" / "systemd" / "system" / "worker.service"
    unit.parent.mkdir(parents=True)
    unit.write_text((DEPLOY / "systemd" / "worker.service").read_text() if text is None else text)
    exe = root / Path(shlex.split(systemd_setting("ExecStart"))[0]).relative_to("/")
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    env = root / systemd_setting("EnvironmentFile").removeprefix("-").lstrip("/")
    env.parent.mkdir(parents=True)
    env.write_text("WORKER_DSN=postgresql://queue_worker@db/app\n")
    return root


def analyze(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE
    return subprocess.run(
        [SYSTEMD_ANALYZE, *args, f"--root={root}", "/etc/systemd/system/worker.service"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )


@needs_systemd_analyze
def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """No error and no warning (systemd-analyze verify exits 0 on an unknown key, saying so on
    stderr; shown here on a broken copy)."""
    r = analyze(unit_root(tmp_path), "verify", "--man=no")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    broken = (DEPLOY / "systemd" / "worker.service").read_text()
    broken = broken.replace("KillMode=mixed", "KillMode=bogus\nNoSuchKey=1")
    r = analyze(unit_root(tmp_path / "broken", broken), "verify", "--man=no")
    assert "kill mode" in r.stderr and "NoSuchKey" in r.stderr, r.stderr


@needs_systemd_analyze
def test_the_systemd_unit_is_hardened(tmp_path: Path) -> None:
    r = analyze(unit_root(tmp_path), "security", "--offline=true", "--no-pager")
    if "--offline" in r.stderr and r.returncode != 0:
        pytest.skip(f"systemd-analyze security --offline needs systemd 250 or newer: {r.stderr}")
    found = re.search(r"Overall exposure level for worker\.service: (\d+\.\d+) (\w+)", r.stdout)
    assert found, r.stdout + r.stderr
    assert float(found[1]) <= EXPOSURE_LIMIT, r.stdout
    # What the worker needs stays open: the network, its own processes.
    assert systemd_setting("RestrictAddressFamilies").split() == ["AF_UNIX", "AF_INET", "AF_INET6"]
    assert systemd_setting("User") == "worker" and systemd_setting("CapabilityBoundingSet") == ""


def test_the_systemd_install_comment_works_in_order() -> None:
    """The unit's install steps: the distribution's name, and the folder of the environment file
    made before the file is."""
    text = (DEPLOY / "systemd" / "worker.service").read_text()
    steps = [x.removeprefix("#").strip() for x in text.splitlines() if x.startswith("#   ")]
    pip = next(s for s in steps if "pip install" in s)
    assert re.search(r"/bin/pip install worker-pg\b", pip), pip
    env_file = systemd_setting("EnvironmentFile").removeprefix("-")
    made = next(i for i, s in enumerate(steps) if s == f"mkdir -p {Path(env_file).parent}")
    installed = next(i for i, s in enumerate(steps) if s.startswith("install ") and env_file in s)
    assert made < installed
    assert "/etc/systemd/system/" in next(s for s in steps if s.startswith("cp "))


STRACE = shutil.which("strace")


def syscall_set(name: str) -> set[str]:
    """The system calls of a systemd-analyze syscall-filter group, nested groups expanded."""
    assert SYSTEMD_ANALYZE
    out = subprocess.run(
        [SYSTEMD_ANALYZE, "syscall-filter", name], capture_output=True, text=True, check=True
    ).stdout
    calls: set[str] = set()
    for line in out.splitlines()[1:]:
        item = line.strip()
        if item.startswith("@"):
            calls |= syscall_set(item)
        elif item and not item.startswith("#"):
            calls.add(item)
    return calls


@needs_systemd_analyze
@pytest.mark.skipif(
    STRACE is None, reason="strace is not installed (Debian: apt-get install strace)"
)
def test_the_worker_lives_within_the_units_system_call_filter(
    pg_dsn: str, schema: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    """`worker run --processes 2` with its metrics server, traced with strace from start to
    SIGTERM (children included) while it runs tasks and answers /metrics and the status page:
    every system call it makes is in the unit's SystemCallFilter (@system-service without
    @privileged), so the filter costs nothing."""
    from conftest import worker_cli
    from test_metrics import fetch, free_port

    allowed, denied = set(), set()
    for line in (DEPLOY / "systemd" / "worker.service").read_text().splitlines():
        if line.startswith("SystemCallFilter="):
            value = line.split("=", 1)[1]
            target = denied if value.startswith("~") else allowed
            for group in value.removeprefix("~").split():
                target |= syscall_set(group) if group.startswith("@") else {group}
    assert allowed and denied
    conn.execute(f"INSERT INTO {schema}.tasks (task) SELECT 'noop' FROM generate_series(1, 20)")
    port = free_port()
    summary = tmp_path / "strace"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "WORKER_DSN": pg_dsn}
    argv = worker_cli(
        *("run", "tasks_module", "--schema", schema, "--processes", "2", "--grace", "5"),
        *("--metrics-host", "0.0.0.0", "--metrics-port", str(port)),
    )
    proc = subprocess.Popen(
        [STRACE, "-f", "-qq", "-c", "-U", "name", "-o", str(summary), *argv],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:
            wait_until(lambda: fetch(f"http://127.0.0.1:{port}/readyz")[0] == 200, timeout=60)
        except AssertionError:
            proc.kill()
            err = proc.communicate()[1]
            if "ptrace" in err or "Operation not permitted" in err:
                pytest.skip(f"strace cannot trace here: {err.strip()[:200]}")
            raise
        wait_until(lambda: states(conn, schema) == {"done": 20}, timeout=60)
        assert fetch(f"http://127.0.0.1:{port}/")[0] == 200
        assert fetch(f"http://127.0.0.1:{port}/metrics")[0] == 200
        import psutil

        tracee = psutil.Process(proc.pid).children()[0]  # the supervisor, under strace
        tracee.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    used = {
        line.split()[-1]
        for line in summary.read_text().splitlines()[2:]
        if line.strip() and not line.startswith("-") and line.split()[-1] != "total"
    }
    assert len(used) > 30, summary.read_text()
    assert used <= allowed - denied, sorted(used - (allowed - denied))


# -- the smoke script (deploy/smoke.sh) ------------------------------------------------------------

SMOKE = DEPLOY / "smoke.sh"


def smoke(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SMOKE), *args],
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, "PYTHON": sys.executable, **(env or {})},
    )


def test_the_smoke_script_is_sound_bash() -> None:
    r = subprocess.run(["bash", "-n", str(SMOKE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert os.access(SMOKE, os.X_OK)
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        r = subprocess.run([shellcheck, str(SMOKE)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


def test_the_smoke_script_says_in_one_line_why_it_cannot_run(tmp_path: Path) -> None:
    """No engine (a `docker` whose `info` fails, as here: a client without a daemon): one SKIP
    verdict line, exit 3, nothing started. A bad flag is a usage error."""
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    fake.chmod(0o755)
    r = smoke("compose", env={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode == 3, r.stdout + r.stderr
    assert re.fullmatch(
        r"smoke compose: SKIP no container engine answers \(docker info: Cannot connect to the "
        r"Docker daemon\) \(\d{4}-\d\d-\d\dT\d\d:\d\dZ\)\n",
        r.stdout,
    ), r.stdout
    assert smoke("compose", "--tasks", "x").returncode == 2
    assert smoke("swarm").returncode == 2


@pytest.mark.parametrize("target", ["kubernetes", "podman"])
def test_the_smoke_manifests_are_the_deploy_ones_adapted(target: str) -> None:
    """What the smoke applies is deploy/k8s with only the image, the demo module, a smaller CPU
    request and (podman) the DSN as a value changed, and it passes the Kubernetes schemas as
    strictly as the manifests themselves (tests/test_deploy_schemas.py)."""
    from test_deploy_schemas import kube_errors

    r = smoke("manifests", target)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    for doc in docs:
        assert kube_errors(doc) == [], (doc["kind"], doc["metadata"]["name"])
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    image = "localhost/worker:local" if target == "podman" else "worker:local"

    def expected(spec: dict[str, Any]) -> dict[str, Any]:
        spec = json.loads(json.dumps(spec))
        for c in spec["containers"]:
            c["image"] = image
            c["imagePullPolicy"] = "Never" if target == "podman" else "IfNotPresent"
            if c["args"][0] == "run":
                c["args"][1] = "worker.dev.demo_tasks"
            c["resources"]["requests"]["cpu"] = "100m"
            if target == "podman":
                for env in c["env"]:
                    env.pop("valueFrom")
                    env["value"] = (
                        "postgresql://worker:worker@host.containers.internal:15432/worker"
                    )
        return spec

    worker = k8s("Deployment", "worker")
    worker_spec = worker["spec"]["template"]["spec"]
    job_spec = k8s("Job", "worker-migrate")["spec"]["template"]["spec"]
    if target == "podman":
        # podman before 4.7 publishes each containerPort on the host: one Deployment per
        # replica, each with a host port of its own and otherwise the pod spec unchanged.
        names = ["worker"] + [f"worker-{i}" for i in range(2, worker["spec"]["replicas"] + 1)]
        host_ports = []
        for name in names:
            played = by_name[("Deployment", name)]
            assert played["spec"]["replicas"] == 1
            spec = json.loads(json.dumps(played["spec"]["template"]["spec"]))
            (port,) = spec["containers"][0]["ports"]
            host_ports.append(port.pop("hostPort"))
            assert spec == expected(worker_spec)
        assert len(set(host_ports)) == len(names) and 9470 not in host_ports
        # podman runs no Job: its pod spec as a Pod, restarted on failure as the Job's pod is.
        pod = by_name[("Pod", "worker-migrate")]["spec"]
        assert pod == expected(job_spec) and pod["restartPolicy"] == "OnFailure"
        assert ("Pod", "smoke-postgres") in by_name
    else:
        played = by_name[("Deployment", "worker")]["spec"]["template"]["spec"]
        assert played == expected(worker_spec)
        assert by_name[("Job", "worker-migrate")]["spec"]["template"]["spec"] == expected(job_spec)
        secret = by_name[("Secret", "worker-db")]["stringData"]
        assert set(secret) == set(k8s("Secret", "worker-db")["stringData"])
        assert ("PodDisruptionBudget", "worker") in by_name
        assert ("Service", "smoke-postgres") in by_name


def engine_problem(command: str, path: str | None) -> str | None:
    """Why ``command`` (found at ``path``) cannot run containers here, or None when it can."""
    if path is None:
        return f"no {command} command on this machine"
    r = subprocess.run([path, "info"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        first = next((x for x in r.stderr.splitlines() if x.strip()), "")
        return f"no container engine answers ({command} info: {first.strip()})"
    return None


def cluster_problem() -> str | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return "no kubectl command on this machine"
    r = subprocess.run([kubectl, "version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return "no Kubernetes cluster answers kubectl (kind or k3d make one)"
    return None


def run_smoke(mode: str) -> None:
    """Run deploy/smoke.sh MODE with its defaults; SKIP (exit 3: a missing base image, say)
    skips with the script's own reason."""
    r = smoke(mode)
    verdict = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.returncode == 3:
        pytest.skip(verdict)
    assert r.returncode == 0 and verdict.startswith(f"smoke {mode}: PASS"), (
        verdict + "\n" + r.stderr[-4000:]
    )
    # The whole line, to its date: what survived what, and the notes of the run.
    assert re.fullmatch(
        rf"smoke {mode}: PASS (\d+)/\1 tasks done, 0 in_progress, \d+ retried, after SIGKILL of "
        r"a worker holding [1-9]\d* \(all done on a later attempt\) and a PostgreSQL restart; "
        r".*migrate applied \d+ migrations \(\d{4}-\d\d-\d\dT\d\d:\d\dZ\)",
        verdict,
    ), verdict


@pytest.mark.deploy
def test_smoke_compose() -> None:
    """The compose stack for real (deploy/smoke.sh compose)."""
    problem = engine_problem("docker", shutil.which("docker"))
    if problem:
        pytest.skip(problem)
    run_smoke("compose")


@pytest.mark.deploy
def test_smoke_podman_kube_play() -> None:
    """The Kubernetes pod specs under `podman kube play` (deploy/smoke.sh podman)."""
    problem = engine_problem("podman", shutil.which("podman"))
    if problem:
        pytest.skip(problem)
    run_smoke("podman")


@pytest.mark.deploy
def test_smoke_kubernetes() -> None:
    """`kubectl apply` of the manifests to the current cluster (deploy/smoke.sh kubernetes)."""
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)
    run_smoke("kubernetes")


# -- stand-in base images for machines without a registry (deploy/base-images) --------------------

BASE_IMAGES = DEPLOY / "base-images"


def test_the_base_image_scripts_are_sound_and_named_as_deploy_uses_them() -> None:
    for script in ("build.sh", "postgres-entrypoint.sh"):
        path = BASE_IMAGES / script
        r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert r.returncode == 0 and os.access(path, os.X_OK), (script, r.stderr)
        if shutil.which("shellcheck"):
            r = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
            assert r.returncode == 0, r.stdout
    build = (BASE_IMAGES / "build.sh").read_text()
    base = next(i.split()[1] for i in dockerfile_instructions() if i.startswith("FROM "))
    postgres = compose()["services"]["postgres"]["image"]
    assert f"build -t {base} " in build and f"build -t {postgres} " in build
    assert postgres == "postgres:16"
    assert re.search(r"^\s+echo postgres:16$", SMOKE.read_text(), re.M)  # what the smoke needs


def _pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


@pytest.mark.db  # starts a PostgreSQL
@pytest.mark.skipif(
    os.geteuid() != 0 or _pg_bin() is None or shutil.which("setpriv") is None,
    reason="runs the stand-in postgres image's entrypoint as its container would: needs root, "
    "a Debian PostgreSQL (apt-get install postgresql) and setpriv",
)
def test_the_stand_in_postgres_entrypoint_does_what_deploy_asks() -> None:
    """postgres-entrypoint.sh as PID 1 of the stand-in image would run it (as root, dropping to
    postgres): the cluster is made with the compose file's user, password and database, local
    connections need no password (pg_isready, psql in the container), others need the right one,
    and a second start keeps the data."""
    import pwd
    import tempfile

    from test_metrics import free_port

    pwd.getpwnam("postgres")
    folder = Path(tempfile.mkdtemp(prefix="worker-pg-standin-", dir="/tmp"))
    folder.chmod(0o755)  # the server runs as postgres and must reach its data
    port = free_port()
    env = {
        "PATH": f"{_pg_bin()}:/usr/sbin:/usr/bin:/sbin:/bin",
        "PGDATA": str(folder / "data"),
        "POSTGRES_SOCKET_DIR": str(folder / "run"),
        **{f"POSTGRES_{k}": "worker" for k in ("USER", "PASSWORD", "DB")},
    }
    entry = [str(BASE_IMAGES / "postgres-entrypoint.sh"), "postgres", "-c", f"port={port}"]
    tcp = f"postgresql://worker:worker@127.0.0.1:{port}/worker"
    local = make_conninfo(host=str(folder / "run"), port=str(port), user="worker", dbname="worker")

    def answers() -> bool:
        try:
            psycopg.connect(local, connect_timeout=5).close()
        except psycopg.OperationalError:
            return False
        return True

    try:
        for start in range(2):
            server = subprocess.Popen(entry, env=env, stderr=subprocess.PIPE, text=True)
            try:
                wait_until(lambda: (folder / "run" / f".s.PGSQL.{port}").exists(), timeout=60)
                wait_until(answers, timeout=30)
                with psycopg.connect(tcp) as c:
                    assert c.execute("SELECT current_user, current_database()").fetchone() == (
                        "worker",
                        "worker",
                    )
                    if start == 0:
                        c.execute("CREATE TABLE kept (x int)")
                    else:
                        assert c.execute("SELECT to_regclass('kept') IS NOT NULL").fetchone()[0]
                with pytest.raises(psycopg.OperationalError, match="password authentication"):
                    psycopg.connect(tcp.replace("worker:worker@", "worker:wrong@")).close()
                owner = Path(f"/proc/{server.pid}/status").read_text()
                uid = next(x.split()[1] for x in owner.splitlines() if x.startswith("Uid:"))
                assert int(uid) == pwd.getpwnam("postgres").pw_uid  # PID 1 is postgres itself
            finally:
                server.send_signal(signal.SIGINT)  # the image's STOPSIGNAL
                _, err = server.communicate(timeout=60)
            assert server.returncode == 0, err
            assert ("created the cluster" in err) == (start == 0), err
    finally:
        shutil.rmtree(folder, ignore_errors=True)
