#!/usr/bin/env python3
"""Checks the Helm chart offline (no helm binary, no cluster); .ci/chart-check installs what it
needs and runs it.

For the chart: values.schema.json describes every key of values.yaml, and the chart's guards
(schema and template `fail`s) refuse a few known-bad values. For each values file under the
chart's ci/: `helm lint --strict` (Helm's own library, through helm-python-sdk) with the file's
values against the Kubernetes version below, a render as `helm template` does, and every rendered
object validated against that version's schemas by kubernetes-validate, strict (an unknown field
is an error). Objects of CRDs it has no schema for (the ServiceMonitor) are checked against a
schema of their own here; any other kind without a schema is an error. Then the objects are
checked against each other (selectors, named ports, probes, the settings every tier needs, the
security context). Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import sys
import time

import helm_python as helm
import jsonschema
import yaml
from kubernetes_validate import utils as kv

KUBE_VERSION = "1.30.0"
RELEASE = "relay"
NAMESPACE = "relay"

# Values each of which the chart must refuse, and a piece of the refusal.
MUST_FAIL = [
    ({"bogus": 1}, "additional properties 'bogus' not allowed"),
    ({"ingest": {"replicas": "two"}}, "/ingest/replicas"),
    ({"ingest": {"env": {"RELAY_INGEST_LISTEN": "0.0.0.0:1"}}}, "is set by the chart"),
    ({"sequencer": {"extraEnv": [{"name": "RELAY_SEQUENCER_METRICS_LISTEN", "value": "x"}]}},
     "is set by the chart"),
    ({"api": {"extraEnv": [{"name": "RELAY_API_JWT_SECRET", "value": "x"}]}}, "cannot be set"),
    ({"jwt": {"previousSecretKey": "previous-key"}}, "set jwt.rotationStartedAt too"),
    ({"ingest": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "minReplicas is above maxReplicas"),
    ({"ingest": {"podDisruptionBudget": {"enabled": True, "minAvailable": "half"}}},
     "/ingest/podDisruptionBudget"),
]

# The tiers' metrics listeners, by the tier's subcommand.
METRICS_LISTEN = {
    "ingest": "RELAY_METRICS_LISTEN",
    "sequencer": "RELAY_SEQUENCER_METRICS_LISTEN",
    "publisher": "RELAY_PUBLISHER_METRICS_LISTEN",
    "api": "RELAY_API_METRICS_LISTEN",
}
SERVING_LISTEN = {"ingest": ("RELAY_INGEST_LISTEN", "webhooks"), "api": ("RELAY_API_LISTEN", "http")}
# What each tier's container must be given (by value or from a Secret).
# Every tier opens the sealed secrets, and `relay migrate` seals an older relay's.
REQUIRED_ENV = {
    "ingest": ["RELAY_DATABASE_URL", "RELAY_REDIS_URL", "RELAY_SEAL_KEYS_FILE"],
    "sequencer": ["RELAY_DATABASE_URL", "RELAY_REDIS_URL", "RELAY_SEAL_KEYS_FILE"],
    "publisher": ["RELAY_DATABASE_URL", "RELAY_REDIS_URL", "RELAY_AMQP_URL", "RELAY_SEAL_KEYS_FILE"],
    "api": ["RELAY_DATABASE_URL", "RELAY_REDIS_URL", "RELAY_AMQP_URL", "RELAY_API_JWT_SECRET_FILE",
            "RELAY_SEAL_KEYS_FILE"],
    "migrate": ["RELAY_DATABASE_URL", "RELAY_SEAL_KEYS_FILE"],
}

# The part of the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1) the chart
# may render, strict like kubernetes-validate's schemas.
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
LABEL_NAME = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": LABEL_NAME}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer", "minimum": 0},
        "replacement": {"type": "string"},
        "action": {"type": "string", "enum": [
            "replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
            "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
            "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
            "dropequal", "DropEqual"]},
    },
}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["key", "operator"],
            "properties": {"key": {"type": "string"},
                           "operator": {"type": "string", "enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
SERVICE_MONITOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object", "additionalProperties": False, "required": ["name"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                           "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                           "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "namespaceSelector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"},
                                   "matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "selector": LABEL_SELECTOR,
                "sampleLimit": {"type": "integer", "minimum": 0},
                "endpoints": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"type": "string", "enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                            "honorLabels": {"type": "boolean"},
                            "honorTimestamps": {"type": "boolean"},
                            "relabelings": {"type": "array", "items": RELABEL},
                            "metricRelabelings": {"type": "array", "items": RELABEL},
                        },
                    },
                },
            },
        },
    },
}

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_KEY_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def duration_seconds(text: str) -> float:
    units = {"y": 31536000, "w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(ms|y|w|d|h|m|s)", text))


@contextlib.contextmanager
def quiet_stderr():
    """Helm's lint logs each template `fail` it meets on stderr: expected where one is meant to."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Report:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def fail(self, where: str, message: str) -> None:
        self.failures.append(f"{where}: {message}")
        print(f"  FAIL {where}: {message}")


# --- the schema against values.yaml ---------------------------------------------------------

def resolve(schema: dict, root: dict) -> dict:
    """Follows $ref and single-branch allOf to the schema that describes the value."""
    while True:
        if "$ref" in schema:
            path = schema["$ref"].removeprefix("#/").split("/")
            schema = root
            for part in path:
                schema = schema[part]
        elif "allOf" in schema and len(schema["allOf"]) == 1 and "properties" not in schema:
            schema = schema["allOf"][0]
        else:
            return schema


def check_schema_describes(values: object, schema: dict, root: dict, path: str, report: Report) -> None:
    schema = resolve(schema, root)
    if not isinstance(values, dict):
        return
    props = schema.get("properties", {})
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        if key in props:
            sub = props[key]
        elif isinstance(schema.get("additionalProperties"), dict):
            sub = schema["additionalProperties"]
        elif schema.get("additionalProperties") is False or props:
            report.fail("values.schema.json", f"values.yaml's {where} is not described")
            continue
        else:
            continue
        sub = resolve(sub, root)
        if "description" not in sub and "description" not in props.get(key, {}) and key in props:
            report.fail("values.schema.json", f"{where} has no description")
        check_schema_describes(value, sub, root, where, report)


# --- one values file ------------------------------------------------------------------------

def lint_errors(result: dict) -> list[str]:
    messages = [m for m in result.get("messages", []) if m.get("severity", 0) >= 2]
    errors = [f"[{m.get('path')}] {m.get('error', '').strip()}" for m in messages
              # Helm says a schema failure twice: for values.yaml, then for the templates.
              if not (m.get("path") == "templates/" and "meet the specifications of the schema" in m.get("error", "")
                      and any(n.get("path") == "values.yaml" for n in messages))]
    for error in result.get("errors") or []:
        if not any(error.strip() in e or e.endswith(error.strip()) for e in errors) \
                and "meet the specifications of the schema" not in error:
            errors.append(error.strip())
    return errors


def expectations(path: str) -> tuple[set[str], set[str]]:
    present: set[str] = set()
    absent: set[str] = set()
    with open(path) as f:
        for line in f:
            m = re.match(r"#\s*expect-(absent-)?kinds:\s*(.*)", line)
            if m:
                kinds = {k.strip() for k in m.group(2).split(",") if k.strip()}
                (absent if m.group(1) else present).update(kinds)
    return present, absent


def render(chart: helm.Chart, values: dict, where: str, report: Report) -> tuple[list[tuple[str, dict]], str]:
    try:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, revision=1, is_install=True)
    except helm.HelmError as e:
        report.fail(where, f"render: {str(e).strip()}")
        return [], ""
    objects: list[tuple[str, dict]] = []
    notes = ""
    for template, text in sorted(rendered.items()):
        if "<no value>" in text:
            report.fail(f"{where} {template}", "renders '<no value>' (a missing value)")
        if template.endswith("NOTES.txt"):
            notes = text
            continue
        if os.path.basename(template).startswith("_"):
            continue
        try:
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError as e:
            report.fail(f"{where} {template}", f"not YAML: {e}")
            continue
        for doc in docs:
            if doc is None:
                continue
            if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
                report.fail(f"{where} {template}", f"not a Kubernetes object: {str(doc)[:80]}")
                continue
            objects.append((template, doc))
    return objects, notes


def validate_objects(objects: list[tuple[str, dict]], where: str, report: Report) -> None:
    for template, obj in objects:
        name = f"{where} {template} {obj['kind']}/{obj.get('metadata', {}).get('name')}"
        if (obj["apiVersion"], obj["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor"):
            for error in jsonschema.Draft202012Validator(SERVICE_MONITOR).iter_errors(obj):
                path = ".".join(str(p) for p in error.absolute_path)
                report.fail(name, f"ServiceMonitor schema: {path}: {error.message}")
            continue
        try:
            kv.validate(obj, KUBE_VERSION, strict=True)
        except kv.ValidationError as e:
            for error in all_schema_errors(obj) or [e]:
                path = ".".join(str(p) for p in error.path)
                report.fail(name, f"Kubernetes {KUBE_VERSION} schema: {path}: {error.message}")
        except (kv.SchemaNotFoundError, kv.InvalidSchemaError, kv.VersionNotSupportedError) as e:
            report.fail(name, e.message)


def all_schema_errors(obj: dict) -> list:
    """Every error of an object kubernetes-validate refused (its validate() stops at the first),
    with the same schema files; empty if its layout is not the one expected."""
    try:
        from referencing import Registry, Resource

        version = [v for v in kv.all_versions()
                   if kv.major_minor(v) <= kv.major_minor(KUBE_VERSION)][-1]
        folder = f"kubernetes-json-schema/v{version}-local-strict"
        group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", obj["apiVersion"])
        schema = kv.schema_contents(f"{folder}/{obj['kind'].lower()}-{group}.json", KUBE_VERSION)
        definitions = kv.schema_contents(f"{folder}/_definitions.json", KUBE_VERSION)
        registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
        validator = jsonschema.Draft202012Validator(schema, registry=registry)
        return sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.path])
    except Exception:  # noqa: BLE001 (the first error is reported anyway)
        return []


def selects(selector: dict, labels: dict) -> bool:
    match = selector.get("matchLabels") or {}
    if not match and not selector.get("matchExpressions"):
        return True
    if any(labels.get(k) != v for k, v in match.items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, vals = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and labels.get(key) in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def check_labels(labels: dict, name: str, report: Report) -> None:
    for key, value in (labels or {}).items():
        prefix, _, base = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN.match(prefix))) or len(base) > 63 \
                or not LABEL_KEY_NAME.match(base):
            report.fail(name, f"label key {key!r} is not valid")
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
            report.fail(name, f"label {key}={value!r} is not a valid label value")


def check_pod(pod: dict, tier: str, name: str, deployment: bool, report: Report) -> None:
    spec = pod["spec"]
    psc = spec.get("securityContext") or {}
    volumes = {v["name"] for v in spec.get("volumes") or []}
    if spec.get("automountServiceAccountToken") is not False:
        report.fail(name, "mounts a service account token (the relay does not use the API)")
    for c in spec["containers"]:
        cname = f"{name} container {c['name']}"
        sc = c.get("securityContext") or {}
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            report.fail(cname, "runAsNonRoot is not true")
        if sc.get("readOnlyRootFilesystem") is not True:
            report.fail(cname, "readOnlyRootFilesystem is not true")
        if sc.get("allowPrivilegeEscalation") is not False:
            report.fail(cname, "allowPrivilegeEscalation is not false")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []) or (sc.get("capabilities") or {}).get("add"):
            report.fail(cname, "capabilities are not all dropped")
        env = c.get("env") or []
        names = [e["name"] for e in env]
        for dup in sorted({n for n in names if names.count(n) > 1}):
            report.fail(cname, f"env {dup} is set twice")
        values = {e["name"]: e.get("value") for e in env}
        for required in REQUIRED_ENV.get(tier, []):
            if required not in values:
                report.fail(cname, f"no {required}")
        for m in c.get("volumeMounts") or []:
            if m["name"] not in volumes:
                report.fail(cname, f"mounts volume {m['name']}, which the pod does not have")
        if not deployment:
            continue
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
        listen = values.get(METRICS_LISTEN[tier])
        if listen != f"0.0.0.0:{ports.get('metrics')}":
            report.fail(cname, f"{METRICS_LISTEN[tier]}={listen!r} does not bind the metrics port "
                               f"{ports.get('metrics')} on every address")
        if tier in SERVING_LISTEN:
            var, port_name = SERVING_LISTEN[tier]
            if values.get(var) != f"0.0.0.0:{ports.get(port_name)}":
                report.fail(cname, f"{var}={values.get(var)!r} does not match port {port_name}")
        for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"),
                            ("readinessProbe", "/readyz")):
            get = ((c.get(probe) or {}).get("httpGet")) or {}
            if get.get("path") != path or get.get("port") != "metrics":
                report.fail(cname, f"{probe} is not GET {path} on the metrics port")
            if probe != "readinessProbe" and (c.get(probe) or {}).get("successThreshold", 1) != 1:
                report.fail(cname, f"{probe}.successThreshold must be 1")


def check_objects(objects: list[tuple[str, dict]], where: str, report: Report) -> None:
    objs = [o for _, o in objects]
    seen: set[tuple[str, str, str]] = set()
    for o in objs:
        md = o.get("metadata") or {}
        key = (o["kind"], md.get("namespace", NAMESPACE), md.get("name", ""))
        name = f"{where} {o['kind']}/{md.get('name')}"
        if key in seen:
            report.fail(name, "rendered twice")
        seen.add(key)
        pattern, limit = (DNS_1035, 63) if o["kind"] in ("Service",) else (DNS_SUBDOMAIN, 253)
        if o["kind"] in ("Job", "Deployment"):
            limit = 63  # in the pods' labels (job-name) and hostnames
        if not md.get("name") or len(md["name"]) > limit or not pattern.match(md["name"]):
            report.fail(name, f"name {md.get('name')!r} is not valid for a {o['kind']}")
        check_labels(md.get("labels"), name, report)

    deployments = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    pods = {n: d["spec"]["template"] for n, d in deployments.items()}

    def selected(selector: dict) -> list[str]:
        return [n for n, p in pods.items() if selects(selector, p["metadata"].get("labels") or {})]

    def port_names(deployment: str) -> set[str]:
        return {p.get("name") for c in pods[deployment]["spec"]["containers"] for p in c.get("ports") or []}

    for n, d in deployments.items():
        name = f"{where} Deployment/{n}"
        tier = d["spec"]["template"]["spec"]["containers"][0]["args"][0]
        if not selects(d["spec"]["selector"], d["spec"]["template"]["metadata"].get("labels") or {}):
            report.fail(name, "its selector does not select its own pods")
        others = [m for m in selected(d["spec"]["selector"]) if m != n]
        if others:
            report.fail(name, f"its selector also selects the pods of {others}")
        check_labels(d["spec"]["template"]["metadata"].get("labels"), name + " pod", report)
        check_pod(d["spec"]["template"], tier, name, True, report)

    for o in objs:
        kind, n = o["kind"], o["metadata"]["name"]
        name = f"{where} {kind}/{n}"
        spec = o.get("spec") or {}
        if kind == "Service":
            targets = selected({"matchLabels": spec.get("selector") or {}})
            if len(targets) != 1:
                report.fail(name, f"selects the pods of {targets or 'no Deployment'}, not of one")
                continue
            for p in spec.get("ports") or []:
                if isinstance(p.get("targetPort"), str) and p["targetPort"] not in port_names(targets[0]):
                    report.fail(name, f"targetPort {p['targetPort']} is not a port of {targets[0]}")
        elif kind == "PodDisruptionBudget":
            if len(selected(spec["selector"])) != 1:
                report.fail(name, "does not select the pods of exactly one Deployment")
        elif kind == "HorizontalPodAutoscaler":
            target = spec["scaleTargetRef"]
            if target["kind"] != "Deployment" or target["name"] not in deployments:
                report.fail(name, f"scales {target['kind']}/{target['name']}, which is not rendered")
            elif "replicas" in deployments[target["name"]]["spec"]:
                report.fail(name, f"{target['name']} sets replicas too (they fight)")
        elif kind == "NetworkPolicy":
            targets = selected(spec["podSelector"])
            if len(targets) != 1:
                report.fail(name, f"applies to {targets or 'no Deployment'}, not to one")
                continue
            for rule in spec.get("ingress") or []:
                for p in rule.get("ports") or []:
                    if isinstance(p.get("port"), str) and p["port"] not in port_names(targets[0]):
                        report.fail(name, f"port {p['port']} is not a port of {targets[0]}")
        elif kind == "Job":
            hooks = set((o["metadata"].get("annotations") or {}).get("helm.sh/hook", "").split(","))
            if not {"pre-install", "pre-upgrade"} <= hooks:
                report.fail(name, "the migration does not run before install and upgrade")
            template = spec["template"]
            if template["spec"]["containers"][0].get("args") != ["migrate"]:
                report.fail(name, "does not run `relay migrate`")
            check_pod(template, "migrate", name, False, report)
        elif kind == "ServiceMonitor":
            services = [s for s in objs if s["kind"] == "Service"
                        and selects(spec["selector"], s["metadata"].get("labels") or {})]
            if NAMESPACE not in (spec.get("namespaceSelector") or {}).get("matchNames", []):
                report.fail(name, f"does not look in the release's namespace {NAMESPACE}")
            for ep in spec["endpoints"]:
                with_port = [s["metadata"]["name"] for s in services
                             if any(p.get("name") == ep.get("port") for p in s["spec"].get("ports") or [])]
                if len(with_port) != len(deployments):
                    report.fail(name, f"endpoint port {ep.get('port')} is on Services {with_port}, "
                                      f"not on one per tier ({len(deployments)})")
                if ep.get("interval") and ep.get("scrapeTimeout") and \
                        duration_seconds(ep["scrapeTimeout"]) > duration_seconds(ep["interval"]):
                    report.fail(name, "scrapeTimeout is longer than interval")


def check_values_file(chart: helm.Chart, chart_dir: str, path: str, report: Report) -> None:
    where = os.path.relpath(path)
    print(f"{where}:")
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        report.fail(where, "is not a mapping")
        return
    result = helm.lint(chart_dir, values, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}")
    errors = lint_errors(result)
    for error in errors:
        report.fail(f"{where} lint", error)
    infos = [m for m in result.get("messages", []) if m.get("severity", 0) < 2]
    print(f"  lint --strict: {len(errors)} error(s), {len(infos)} note(s)"
          + "".join(f"\n    note: [{m.get('path')}] {m.get('error')}" for m in infos))
    objects, notes = render(chart, values, where, report)
    if not objects:
        return
    if not notes.strip():
        report.fail(where, "NOTES.txt renders empty")
    kinds: dict[str, int] = {}
    for _, o in objects:
        kinds[o["kind"]] = kinds.get(o["kind"], 0) + 1
    print(f"  rendered {len(objects)} objects: "
          + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    present, absent = expectations(path)
    for kind in sorted(present - set(kinds)):
        report.fail(where, f"renders no {kind} (expected by its expect-kinds line)")
    for kind in sorted(absent & set(kinds)):
        report.fail(where, f"renders a {kind} (its expect-absent-kinds line says none)")
    before = len(report.failures)
    validate_objects(objects, where, report)
    print(f"  kubernetes-validate {KUBE_VERSION} --strict (ServiceMonitor: its CRD's schema here): "
          + ("ok" if len(report.failures) == before else "FAILED"))
    before = len(report.failures)
    check_objects(objects, where, report)
    print("  selectors, ports, probes, env, securityContext: "
          + ("ok" if len(report.failures) == before else "FAILED"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chart", default="helm/relay")
    parser.add_argument("values", nargs="*", help="values files (default: <chart>/ci/*.yaml)")
    args = parser.parse_args()
    started = time.monotonic()
    chart_dir = args.chart
    files = args.values or sorted(glob.glob(os.path.join(chart_dir, "ci", "*.yaml")))
    if not files:
        print(f"no values files under {chart_dir}/ci", file=sys.stderr)
        return 1
    report = Report()
    print(f"Helm {helm.helm_sdk_version()} (helm-python-sdk {helm.__version__}), "
          f"kubernetes-validate {kv.__version__}, Kubernetes {KUBE_VERSION}")

    print("values.schema.json against values.yaml:")
    with open(os.path.join(chart_dir, "values.yaml")) as f:
        defaults = yaml.safe_load(f)
    with open(os.path.join(chart_dir, "values.schema.json")) as f:
        schema = json.load(f)
    before = len(report.failures)
    check_schema_describes(defaults, schema, schema, "", report)
    print("  every value described: " + ("ok" if len(report.failures) == before else "FAILED"))

    results: list[tuple[str, bool]] = [("values.schema.json", len(report.failures) == before)]

    print("values the chart must refuse:")
    before = len(report.failures)
    for values, expected in MUST_FAIL:
        # Helm's lint only logs a template's `fail`: a render must refuse them too.
        with quiet_stderr():
            result = helm.lint(chart_dir, values, strict=True, namespace=NAMESPACE,
                               kube_version=f"v{KUBE_VERSION}")
        errors = lint_errors(result)
        try:
            with helm.Chart.load(chart_dir) as chart:
                chart.render(values, name=RELEASE, namespace=NAMESPACE, revision=1, is_install=True)
        except helm.HelmError as e:
            errors.append(f"render: {e}")
        if not any(expected in e for e in errors):
            report.fail("guards", f"{json.dumps(values)} was not refused with '{expected}' "
                                  f"(lint said: {errors or 'nothing'})")
        else:
            print(f"  refused: {json.dumps(values)}")

    results.append(("guards", len(report.failures) == before))
    with helm.Chart.load(chart_dir) as chart:
        for path in files:
            before = len(report.failures)
            check_values_file(chart, chart_dir, path, report)
            results.append((path, len(report.failures) == before))

    elapsed = time.monotonic() - started
    if report.failures:
        print(f"{len(report.failures)} failure(s): the FAIL lines above")
    passed = sum(ok for _, ok in results)
    print(f"checked in {elapsed:.1f} s")
    print(f"chart-check: {passed} passed, {len(results) - passed} failed")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
