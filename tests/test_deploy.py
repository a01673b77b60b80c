"""deploy/ must stay true to the code: files parse, commands parse with the real CLI parser, ports,
grace periods, schema names and metric names agree, alert rules pass promtool, and the roles in
deploy/sql/roles.sql grant exactly what producers and workers need (checked on a real database)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
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
        dsn=dsn, schema=schema, queues=[queue], poll_interval=0.1, lease_seconds=2
    )
    with ThreadWorker(config, reg) as tw:
        wait_until(lambda: states(conn, schema) == {"done": 2, "failed": 1})
        tw.stop()

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
