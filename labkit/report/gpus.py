"""The GPUs of a run as their owners describe them, from the manifest's `gpus` section: one short line beside
the figures ("RTX 3090 x3 · 220 W of 350 W · SM 1695 MHz max, 1410 median · throttled: sw_power_cap 62% ·
P2P: none"), the detail in the report's machine section, and the few words `labkit runs` has room for.

A manifest written before runs recorded this has no `gpus` section: every function here then returns an empty
string, and the report and the index show what they showed before.
"""
from __future__ import annotations

from statistics import median

from ..telemetry import NOT_A_LIMIT

SECTION_TITLE = "GPUs as they ran"


def short_name(name: str) -> str:
    """`NVIDIA GeForce RTX 3090` -> `RTX 3090`, `NVIDIA H200` -> `H200`."""
    for word in ("NVIDIA ", "GeForce "):
        name = name.replace(word, "")
    return name.strip()


def _devices(mf: dict) -> list[dict]:
    g = mf.get("gpus")
    return (g.get("devices") or []) if isinstance(g, dict) else []


def _names(devs: list[dict]) -> str:
    counts: dict[str, int] = {}
    for d in devs:
        n = short_name(str(d.get("name") or "GPU"))
        counts[n] = counts.get(n, 0) + 1
    return " + ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())


def _w(v: float) -> str:
    return f"{v:.0f}"


def power_text(devs: list[dict]) -> str:
    """`220 W of 350 W` (enforced of default); a range where the cards differ; empty where NVML read none."""
    on = [d["power_limit_w"] for d in devs if d.get("power_limit_w")]
    dflt = [d["default_power_limit_w"] for d in devs if d.get("default_power_limit_w")]
    if not on:
        return ""
    cap = _w(on[0]) if min(on) == max(on) else f"{_w(min(on))}–{_w(max(on))}"
    of = "" if not dflt else f" of {_w(dflt[0])} W" if min(dflt) == max(dflt) else f" of {_w(min(dflt))}–{_w(max(dflt))} W"
    return f"{cap} W{of}"


def capped(mf: dict) -> bool:
    """Does any GPU of the run run below its default power limit (the owner's cap)?"""
    return any(d.get("power_limit_w") and d.get("default_power_limit_w") and d["power_limit_w"] < d["default_power_limit_w"] - 0.5
               for d in _devices(mf))


def _observed(devs: list[dict]) -> list[dict]:
    return [d["observed"] for d in devs if isinstance(d.get("observed"), dict) and d["observed"].get("samples")]


def clocks_text(devs: list[dict]) -> str:
    obs = [o["sm_clock_mhz"] for o in _observed(devs) if o.get("sm_clock_mhz")]
    if not obs:
        return ""
    return f"SM {max(o['max'] for o in obs):.0f} MHz max, {median(o['median'] for o in obs):.0f} median"


def event_shares(devs: list[dict]) -> dict[str, float]:
    """Each clock-event reason's share of the samples of all the run's GPUs together (weighted by samples)."""
    total, hits = 0, {}
    for o in _observed(devs):
        n = o.get("clock_event_samples") or 0
        total += n
        for name, share in (o.get("clock_events") or {}).items():
            hits[name] = hits.get(name, 0.0) + share * n
    return {k: v / total for k, v in sorted(hits.items(), key=lambda kv: -kv[1])} if total else {}


def throttle_text(devs: list[dict], top: int = 2) -> str:
    """`throttled: sw_power_cap 62%`: the reasons that held the clocks down (idle is not one), the most frequent
    first; `throttled: none` when none was seen; empty when the clock events were not sampled."""
    if not any(o.get("clock_event_samples") for o in _observed(devs)):
        return ""
    limits = [(n, s) for n, s in event_shares(devs).items() if n not in NOT_A_LIMIT and s >= 0.005]
    if not limits:
        return "throttled: none"
    more = f" (+{len(limits) - top})" if len(limits) > top else ""
    return "throttled: " + ", ".join(f"{n} {s:.0%}" for n, s in limits[:top]) + more


def peer_text(mf: dict) -> str:
    """`P2P: none` / `P2P: all pairs` / `P2P: 1 of 3 pairs`, with several GPUs; empty with one."""
    pairs = (mf.get("gpus") or {}).get("peer") or []
    if not pairs:
        return ""
    ok = sum(bool(p.get("cuda_peer")) for p in pairs)
    nvlink = sum(p.get("nvml_nvlink") == "ok" for p in pairs)
    what = "none" if ok == 0 else "all pairs" if ok == len(pairs) else f"{ok} of {len(pairs)} pairs"
    return f"P2P: {what}" + (" (NVLink)" if nvlink and nvlink == ok else "")


def gpu_line(mf: dict) -> str:
    """The run's GPUs in one line; a CPU run's line says it had none; empty for a manifest without `gpus`."""
    g = mf.get("gpus")
    if not isinstance(g, dict):
        return ""
    devs = _devices(mf)
    if not devs:
        return f"no GPU ({g.get('none') or 'none recorded'})"
    parts = [_names(devs), power_text(devs), clocks_text(devs) or "clocks not sampled", throttle_text(devs), peer_text(mf)]
    return " · ".join(p for p in parts if p)


def machine_cell(mf: dict) -> str:
    """The line after what the index's machine label says already (the GPU, its count, a power cap): the power
    limit where it is the default, the clocks, what held them down, peer access."""
    devs = _devices(mf)
    if not devs:
        return ""
    parts = ["" if capped(mf) else power_text(devs), clocks_text(devs), throttle_text(devs), peer_text(mf)]
    return " · ".join(p for p in parts if p)


def short_machine(mf: dict) -> str:
    """What `labkit runs` has room for: `RTX 3090 x3 220/350 W` (the power only where a card is capped);
    empty for a manifest without GPUs recorded."""
    devs = _devices(mf)
    if not devs:
        return ""
    out = _names(devs)
    if capped(mf):
        on = max(d["power_limit_w"] for d in devs if d.get("power_limit_w"))
        out += f" {_w(on)}/{_w(max(d['default_power_limit_w'] for d in devs if d.get('default_power_limit_w')))} W"
    return out


def _cell(v, unit: str = "") -> str:
    if v is None:
        return "—"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = f"{v:,.0f}"
    return f"{v}{unit}"


def _spread(s: dict | None, unit: str) -> str:
    return "—" if not s else f"{s['min']:,.0f} / {s['median']:,.0f} / {s['max']:,.0f}{unit}"


def gpu_section(mf: dict) -> str:
    """The machine section (markdown): per GPU its limits and what it did over the run, the clock-event reasons
    per GPU, and with several GPUs the peer access of each pair. Empty for a manifest without GPUs."""
    g, devs = mf.get("gpus"), _devices(mf)
    if not devs:
        return ""
    lines = [f"## {SECTION_TITLE}", "",
             "Each GPU the run used, as it was set at the start (NVML) and what it did over the run (its NVML samples: "
             "clocks while busy, min / median / max; each clock-event reason's share of all samples). A power limit "
             "below the default, or a reason such as `sw_power_cap` or `hw_slowdown` seen often, makes the same card "
             "another machine: compare figures only between runs that agree here.", ""]
    if g.get("nvml"):
        lines += [f"NVML could not be read: {g['nvml']}. No limit or clock is shown.", ""]
    lines += ["| GPU | power limit (default) | SM max | memory max | SM while busy | memory while busy | power drawn | "
              "temperature | samples | PCIe max | NVLink links |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in devs:
        o = d.get("observed") or {}
        lim = "—" if d.get("power_limit_w") is None else \
            f"{d['power_limit_w']:.0f} W ({_cell(d.get('default_power_limit_w'), ' W')})"
        pcie = f"gen{d['pcie_max_gen']} x{d['pcie_max_width']}" if d.get("pcie_max_gen") else "—"
        lines.append(f"| {d['index']}: {d.get('name')} | {lim} | {_cell(d.get('max_sm_clock_mhz'), ' MHz')} | "
                     f"{_cell(d.get('max_mem_clock_mhz'), ' MHz')} | {_spread(o.get('sm_clock_mhz'), ' MHz')} | "
                     f"{_spread(o.get('mem_clock_mhz'), ' MHz')} | {_spread(o.get('power_w'), ' W')} | "
                     f"{_spread(o.get('temp_c'), ' °C')} | {o.get('samples', 0)} ({o.get('source', 'not sampled')}) | "
                     f"{pcie} | {_cell(d.get('nvlink_active_links')) if d.get('nvlink_active_links') is not None else 'none'} |")
    lines += ["", "**Clock-event reasons** (share of samples; `idle`: nothing ran, not a limit):", ""]
    for d in devs:
        ev = (d.get("observed") or {}).get("clock_events")
        seen = ", ".join(f"`{n}` {s:.0%}" for n, s in ev.items()) if ev else \
            "none seen" if (d.get("observed") or {}).get("clock_event_samples") else "not sampled"
        lines.append(f"- GPU {d['index']}: {seen}")
    pairs = g.get("peer") or []
    if pairs:
        lines += ["", "**Peer-to-peer copies between GPUs** (CUDA: `can_device_access_peer` both ways; NVML: P2P "
                  "status for reads, writes and over NVLink; the PCIe path between them):", "",
                  "| pair | CUDA peer access | NVML read | NVML write | NVLink | path |", "|---|---|---|---|---|---|"]
        for p in pairs:
            lines.append(f"| {p['a']}–{p['b']} | {'yes' if p.get('cuda_peer') else 'no'} | {p.get('nvml_read') or '—'} | "
                         f"{p.get('nvml_write') or '—'} | {p.get('nvml_nvlink') or '—'} | {p.get('path') or '—'} |")
    return "\n".join(lines)
