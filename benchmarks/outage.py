"""Provider outage: the same traffic through the sidecar with the primary's breaker off and on.

    .venv/bin/python benchmarks/outage.py [--quick] [--scenarios 503,empty_turn] [--out STEM]

Two lean upstreams (``benchmarks/upstream.py``), each in its own process: the
primary and a healthy fallback; the sidecar in front (route: primary, then
fallback); ``benchmarks/loadgen.py open`` sends a fixed rate of JSON chat requests
(open loop, so both configurations get exactly the same offered traffic).

Each scenario: healthy warm-up, then the primary fails for a sustained period
in one way, then recovers:

* ``503``: answers every request with 503 (a retryable status);
* ``sse_error``: answers 200 ``text/event-stream`` whose first events are a
  role-only chunk and ``data: {"error": {... "server_error"}}`` (an in-stream error
  before any output: the sidecar's ``sse_error``, a failure like a 5xx);
* ``empty_turn``: answers 200 with an empty turn (upstream mode ``empty``: a
  ``chat.completion`` whose content is ``""``, ``"finish_reason":"stop"``, with a
  usage block): the sidecar's ``empty_turn``, a failure retried once, then fallback;
* ``refuse``: stops listening and drops its connections (connects refused);
* ``blackhole``: accepts and reads requests, never sends a byte (first-byte timeout).

Each runs with ``[upstreams.primary.circuit_breaker]`` absent ("off") and present
("on"), with a fresh sidecar. Reported per scenario, over the requests *sent
during the outage*: client p50/p99 latency, success rate (HTTP 200 from either
upstream), and the calls that reached the primary (the sidecar's
``sidecar_upstream_attempts_total{upstream="primary"}`` delta; and the requests
the primary's process actually read); the primary's answers the client got
(empty turns in ``empty_turn``); then the time from the primary's recovery to the
first answer relayed from it again, and until every answer comes from it; and
``sidecar_tokens_total`` over the outage and at the end (``relayed="false"``: tokens
of answers the client never got).

``--scenarios`` (or ``--modes``) picks scenarios. Writes
``benchmarks/results/outage.{md,png,json}`` (``--quick``: ``outage-quick.*``;
``--out STEM``: ``STEM.*``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl

MODES = ["503", "sse_error", "empty_turn", "refuse", "blackhole"]
UPSTREAM_MODE = {"empty_turn": "empty"}
"""The scenario's ``benchmarks/upstream.py`` mode, when its name differs."""

CONFIG = """request_timeout_ms = 30000

[upstreams.primary]
base_url = "http://127.0.0.1:{primary}"
connect_timeout_ms = 1000
first_byte_timeout_ms = {first_byte_ms}
{breaker}
[upstreams.fallback]
base_url = "http://127.0.0.1:{fallback}"

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{{ upstream = "primary" }}, {{ upstream = "fallback" }}]
"""

BREAKER = """[upstreams.primary.circuit_breaker]
failure_threshold = 3
cooldown_ms = {cooldown_ms}
"""


def _label(line: str, name: str) -> str:
    return line.split(f'{name}="', 1)[1].split('"', 1)[0]


def scrape(admin: int) -> tuple[dict[str, float], dict[str, float]]:
    """From the sidecar's /metrics: the primary's attempts by outcome, and
    ``sidecar_tokens_total`` by ``upstream/relayed/kind``."""
    _, body = bl.http_get(admin, "/metrics")
    attempts: dict[str, float] = {}
    tokens: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("sidecar_upstream_attempts_total{") and 'upstream="primary"' in line:
            outcome = _label(line, "outcome")
            attempts[outcome] = attempts.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("sidecar_tokens_total{"):
            key = "/".join(_label(line, k) for k in ("upstream", "relayed", "kind"))
            tokens[key] = tokens.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return attempts, tokens


def run_scenario(
    procs: bl.Procs,
    wd: Path,
    args: argparse.Namespace,
    primary: bl.Proc,
    p_port: int,
    f_port: int,
    mode: str,
    breaker: bool,
) -> dict[str, Any]:
    name = f"{mode}-{'on' if breaker else 'off'}"
    listen, admin = bl.free_port(), bl.free_port()
    body = CONFIG.format(
        primary=p_port,
        fallback=f_port,
        first_byte_ms=args.first_byte_ms,
        breaker=BREAKER.format(cooldown_ms=args.cooldown_ms) if breaker else "",
    )
    config = bl.write_sidecar_config(wd / f"{name}.toml", body, listen=listen, admin=admin)
    sc = bl.start_sidecar(procs, f"sidecar-{name}", config)
    out = wd / f"{name}.jsonl"
    total = args.warm + args.outage + args.recovery
    cmd = [bl.PY, str(bl.HERE / "loadgen.py"), "open"]
    cmd += ["--url", f"http://127.0.0.1:{listen}/v1/chat/completions", "--rate", str(args.rate)]
    cmd += ["--duration", str(total), "--out", str(out), "--timeout", "30"]
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=bl.ROOT)
    try:
        time.sleep(args.warm)
        before = bl.upstream_stats(primary)
        att0, tok0 = scrape(admin)
        t_fail = json.loads(primary.send(f"mode {UPSTREAM_MODE.get(mode, mode)}"))["at"]
        time.sleep(args.outage)
        att1, tok1 = scrape(admin)
        t_ok = json.loads(primary.send("mode ok"))["at"]
        during = bl.upstream_stats(primary)
        gen_out, _ = gen.communicate(timeout=args.recovery + 60)
        after = bl.upstream_stats(primary)
        _, tok_end = scrape(admin)
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()
    status = procs.stop(sc)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    in_outage = [r for r in recs if t_fail <= r["t"] < t_ok]
    after_ok = sorted((r for r in recs if r["t"] >= t_ok), key=lambda r: r["t"])
    lat = sorted(r["latency"] for r in in_outage)
    ok = [r for r in in_outage if r["status"] == 200 and not r["error"]]
    # The failing primary's answers the client got (empty turns in empty_turn): a 200
    # relayed from it that ended before the recovery.
    from_primary = [r for r in ok if r["upstream"] == "primary" and r["t"] + r["latency"] < t_ok]
    first_primary = next((r for r in after_ok if r["upstream"] == "primary"), None)
    not_primary = [r for r in after_ok if r["upstream"] != "primary"]
    all_back = max(r["t"] + r["latency"] for r in not_primary) - t_ok if not_primary else 0.0
    if not_primary and not_primary[-1] is after_ok[-1]:
        all_back = float("nan")  # never fully back within the window
    server_first = after["first_ok_after_switch"]
    return {
        "scenario": name,
        "mode": mode,
        "breaker": breaker,
        "requests": len(in_outage),
        "p50_ms": bl.percentile(lat, 50) * 1000,
        "p90_ms": bl.percentile(lat, 90) * 1000,
        "p99_ms": bl.percentile(lat, 99) * 1000,
        "success": len(ok) / max(len(in_outage), 1),
        "errors": sorted({r["error"] or f"http_{r['status']}" for r in in_outage} - {"http_200"}),
        "primary_answers_relayed": len(from_primary),
        "primary_attempts": sum(att1.values()) - sum(att0.values()),
        "primary_attempts_by_outcome": {k: v - att0.get(k, 0.0) for k, v in att1.items()},
        "primary_received": during["requests"] - before["requests"],
        "tokens_outage": {k: v - tok0.get(k, 0.0) for k, v in tok1.items() if v - tok0.get(k, 0.0)},
        "tokens_end": tok_end,
        "recovery_first_s": (
            first_primary["t"] + first_primary["latency"] - t_ok if first_primary else float("nan")
        ),
        "recovery_server_s": server_first - t_ok if server_first else float("nan"),
        "recovery_all_s": all_back,
        "t_fail": t_fail,
        "t_ok": t_ok,
        "records": [
            [round(r["t"] - t_fail, 4), round(r["latency"], 4), r["status"], r["upstream"]]
            for r in recs
        ],
        "sidecar_exit": status,
        "loadgen": gen_out.strip().splitlines()[-1] if gen_out.strip() else "",
    }


def chart(path: Path, results: list[dict[str, Any]], args: argparse.Namespace) -> bool:
    plt = bl.matplotlib_pyplot()
    if plt is None:
        return False
    modes = list(dict.fromkeys(r["mode"] for r in results))
    fig, axes = plt.subplots(
        len(modes), 2, figsize=(14, 3.2 * len(modes) + 0.6), sharex=True, squeeze=False
    )
    colors = {"primary": "tab:blue", "fallback": "tab:green", "": "tab:red"}
    for res in results:
        ax = axes[modes.index(res["mode"])][1 if res["breaker"] else 0]
        for who, color in colors.items():
            pts = [(t, lat * 1000) for t, lat, _, up in res["records"] if up == who]
            if pts:
                label = who or "sidecar error / no answer"
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, c=color, label=label)
        ax.axvspan(0, res["t_ok"] - res["t_fail"], color="tab:red", alpha=0.08)
        ax.set_yscale("log")
        ax.set_ylim(0.3, 5e4)
        ax.set_title(
            f"primary {res['mode']}, breaker {'on' if res['breaker'] else 'off'}: "
            f"p99 {res['p99_ms']:.0f} ms, {res['primary_attempts']:.0f} calls to primary",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
        ax.set_ylabel("latency, ms")
        ax.legend(fontsize=7, loc="upper right", markerscale=3)
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the outage began (shaded: outage)")
    fig.suptitle(
        f"Client latency per request at {args.rate:g} req/s: which upstream answered",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def report(args: argparse.Namespace, info: dict[str, str], results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        rows.append(
            [
                r["mode"],
                "on" if r["breaker"] else "off",
                r["requests"],
                r["p50_ms"],
                r["p90_ms"],
                r["p99_ms"],
                f"{r['success']:.1%}",
                r.get("primary_answers_relayed", "-"),
                int(r["primary_attempts"]),
                int(r["primary_received"]),
                r["recovery_first_s"],
                r["recovery_all_s"],
            ]
        )
    sample = CONFIG.format(
        primary="P",
        fallback="F",
        first_byte_ms=args.first_byte_ms,
        breaker=BREAKER.format(cooldown_ms=args.cooldown_ms),
    )
    head = ["primary", "breaker", "requests", "p50 ms", "p90 ms", "p99 ms", "success"]
    head += ["primary answers relayed"]
    head += ["calls to primary", "primary read", "recovery: first s", "recovery: all s"]
    lines = [
        "# Provider outage: breaker off vs on",
        "",
        f"Command: `{bl.command_line()}`",
        "",
        bl.machine_md(info),
        "",
        f"Open-loop traffic at {args.rate:g} JSON requests/s for {args.warm:g} s healthy, "
        f"{args.outage:g} s of primary outage, {args.recovery:g} s after recovery. "
        "Latency, success and calls count the requests sent during the outage.",
        "",
        bl.md_table(head, rows),
        "",
        "- **calls to primary**: upstream attempts the sidecar made to the primary during the "
        'outage (`sidecar_upstream_attempts_total{upstream="primary"}` delta: retries '
        "and refused connects included; an attempt is counted when it ends, so blackholed "
        "attempts still waiting at the recovery are missing here but not in *primary read*).",
        "- **primary read**: requests the primary's process read in that time "
        "(0 when it refuses connections).",
        "- **primary answers relayed**: 200s from the failing primary that the client got "
        "(answer ended before the recovery): in `empty_turn`, the empty turns the client "
        "got; 0 when the sidecar always moved on to the fallback.",
        "- **recovery: first**: from the primary's recovery to the first response relayed "
        "from it (breaker on: the rest of the cooldown, then one probe).",
        "- **recovery: all**: from recovery until the last response relayed from the "
        "fallback (or failed) ended; after that every answer came from the primary.",
        "",
        "Failure modes: `503` answers 503 at once (retryable: 1 + 2 retries with 250/500 ms "
        "backoff, then fallback); `sse_error` answers 200 `text/event-stream` with a "
        "role-only chunk and an error event before any output (`sse_error`: retried like a "
        "5xx, then fallback); `refuse` closes its listener and connections (connect "
        "refused: retried like a reset, then fallback); `blackhole` reads the request and "
        f"never answers (first-byte timeout {args.first_byte_ms} ms, not retried: fallback); "
        "`empty_turn` answers 200 with an empty turn (a `chat.completion` whose content is "
        '`""`, `"finish_reason":"stop"`, with a usage block: `empty_turn`, a failure with '
        "the upstream's `empty_turn_is_failure`, the default; retried once, then fallback; "
        "on a half-open probe it is neutral: it still moves on, the breaker stays half-open).",
        "",
        *tokens_md(results),
        "Sidecar config (breaker on; off = without the circuit_breaker table):",
        "",
        *bl.sidecar_config_md(sample),
        "",
        "![outage](outage.png)",
    ]
    return "\n".join(lines) + "\n"


def tokens_md(results: list[dict[str, Any]]) -> list[str]:
    """``sidecar_tokens_total`` per scenario, over the outage and at the end."""
    keys = sorted({k for r in results for k in (*r["tokens_outage"], *r["tokens_end"])})
    if not keys:
        return []
    rows = []
    for r in results:
        for when in ("outage", "end"):
            vals = r[f"tokens_{when}"]
            rows.append(
                [r["mode"], "on" if r["breaker"] else "off", when]
                + [f"{vals.get(k, 0.0):,.0f}" for k in keys]
            )
    head = ["primary", "breaker", "when"] + [f"`{k}`" for k in keys]
    return [
        "`sidecar_tokens_total` by `upstream/relayed/kind`: its increase over the outage, "
        "and its value at the end of the run (healthy warm-up and recovery included). "
        '`relayed="false"`: tokens of answers the client never got (here the empty '
        "turns the sidecar dropped).",
        "",
        bl.md_table(head, rows),
        "",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter phases (about 1.5 minutes)")
    p.add_argument("--rate", type=float, default=50.0, help="requests per second")
    p.add_argument("--warm", type=float, default=None)
    p.add_argument("--outage", type=float, default=None)
    p.add_argument("--recovery", type=float, default=None)
    p.add_argument("--cooldown-ms", type=int, default=5000)
    p.add_argument("--first-byte-ms", type=int, default=2000)
    p.add_argument(
        "--modes",
        "--scenarios",
        dest="modes",
        default=",".join(MODES),
        help=f"comma-separated scenarios (default: all of {','.join(MODES)})",
    )
    p.add_argument("--out", default=None, help="results file stem in benchmarks/results")
    args = p.parse_args()
    args.warm = args.warm if args.warm is not None else (2.0 if args.quick else 3.0)
    args.outage = args.outage if args.outage is not None else (6.0 if args.quick else 15.0)
    args.recovery = args.recovery if args.recovery is not None else (7.0 if args.quick else 10.0)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--scenarios: pick from {', '.join(MODES)}")
    info = bl.machine()
    started = time.monotonic()
    results = []
    with bl.workdir("bench-outage-") as wd, bl.Procs(wd) as procs:
        primary, p_port = bl.start_upstream(procs, "primary")
        _, f_port = bl.start_upstream(procs, "fallback")
        for mode in modes:
            for breaker in (False, True):
                bl.progress(f"primary {mode}, breaker {'on' if breaker else 'off'}")
                r = run_scenario(procs, wd, args, primary, p_port, f_port, mode, breaker)
                results.append(r)
                bl.progress(
                    f"  p50 {r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms "
                    f"success {r['success']:.1%} calls to primary {r['primary_attempts']:.0f} "
                    f"primary answers relayed {r['primary_answers_relayed']} "
                    f"recovery {r['recovery_first_s']:.2f} s / {r['recovery_all_s']:.2f} s"
                )
    info["loadavg at end"] = bl.loadavg()
    stem = args.out or ("outage-quick" if args.quick else "outage")
    md = report(args, info, results).replace("(outage.png)", f"({stem}.png)")
    bl.RESULTS.mkdir(parents=True, exist_ok=True)
    (bl.RESULTS / f"{stem}.md").write_text(md)
    if not chart(bl.RESULTS / f"{stem}.png", results, args):
        print("note: no chart (matplotlib unavailable)")
    bl.write_json(
        f"{stem}.json",
        {"command": bl.command_line(), "machine": info, "args": vars(args), "results": results},
    )
    print(md)
    print(f"took {(time.monotonic() - started) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
