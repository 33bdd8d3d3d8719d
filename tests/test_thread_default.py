"""The default thread count of the models and commands (pagedkv.models.threads.choose_num_threads).

Every reading of the machine goes through injectable readers, so each case feeds fake
affinity masks, cgroup files and /proc/stat samples and checks the choice against what
the rule says for those readings: threads = idle cores of the mask rounded to the
nearest core, between 1 and the usable cores (mask, capped by the quota rounded down).
"""
import numpy as np
import pytest

from pagedkv.models import threads
from pagedkv.models.threads import (
    ThreadChoice,
    cgroup_cpu_limit,
    choose_num_threads,
    idle_cores,
)


def proc_stat(ticks):
    """/proc/stat text for {cpu: (busy ticks, idle ticks)}; busy split over user and system."""
    total_busy = sum(b for b, _ in ticks.values())
    total_idle = sum(i for _, i in ticks.values())
    lines = [f"cpu  {total_busy} 0 0 {total_idle} 0 0 0 0 0 0"]
    for cpu, (busy, idle) in sorted(ticks.items()):
        lines.append(f"cpu{cpu} {busy - busy // 2} 0 {busy // 2} {idle} 0 0 0 0 0 0")
    lines += ["intr 12345 0 0", "ctxt 999", "btime 1700000000", "processes 42"]
    return "\n".join(lines) + "\n"


class FakeMachine:
    """Readings of a machine: files by path; /proc/stat advances by ``per_sample`` at each sleep."""

    def __init__(self, files=None, start=None, per_sample=None):
        self.files = dict(files or {})
        self.ticks = dict(start or {})
        self.per_sample = per_sample or {}
        self.sleeps = []

    def read_text(self, path):
        if path == "/proc/stat":
            return proc_stat(self.ticks) if self.ticks else None
        return self.files.get(path)

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        for cpu, (busy, idle) in self.per_sample.items():
            b, i = self.ticks[cpu]
            self.ticks[cpu] = (b + busy, i + idle)


def machine(idle_per_cpu, files=None, cpus=(0, 1)):
    """A machine whose CPUs ``cpus`` spend the given idle ticks out of 4 during the sample."""
    start = {cpu: (1000 * (cpu + 1), 5000) for cpu in cpus}
    per_sample = {cpu: (4 - idle, idle) for cpu, idle in zip(cpus, idle_per_cpu)}
    return FakeMachine(files, start, per_sample)


def choose(fake, affinity=(0, 1), cpu_count=2):
    return choose_num_threads(read_text=fake.read_text, affinity=lambda: set(affinity) if affinity else None,
                              cpu_count=lambda: cpu_count, sleep=fake.sleep)


# ---------------------------------------------------------------- load sample
@pytest.mark.parametrize("idle_per_cpu, expected_threads", [
    ((4, 4), 2),  # idle machine: both cores
    ((0, 0), 1),  # a neighbour holds both cores
    ((4, 0), 1),  # one core held
    ((2, 2), 1),  # half of each core held: 1.0 idle
    ((3, 3), 2),  # 1.5 idle rounds up
    ((3, 2), 1),  # 1.25 idle rounds down
])
def test_two_cores_take_the_idle_ones(idle_per_cpu, expected_threads):
    fake = machine(idle_per_cpu)
    choice = choose(fake)
    assert choice.num_threads == expected_threads
    assert choice.usable_cores == 2
    assert choice.idle_cores == pytest.approx(sum(idle_per_cpu) / 4)
    assert fake.sleeps == [threads.LOAD_SAMPLE_SECONDS]
    assert "2 usable cores" in choice.reason and "idle" in choice.reason


def test_only_the_cpus_of_the_affinity_mask_are_sampled():
    # 4 CPUs: 0 and 1 busy, 2 and 3 idle; the process may run on 0, 1 and 2 only.
    fake = machine((0, 0, 4, 4), cpus=(0, 1, 2, 3))
    choice = choose(fake, affinity=(0, 1, 2), cpu_count=4)
    assert (choice.num_threads, choice.usable_cores, choice.idle_cores) == (1, 3, 1.0)
    assert "3 CPUs in the affinity mask" in choice.reason
    assert idle_cores({2, 3}, fake.read_text, fake.sleep) == 2.0


def test_without_an_affinity_mask_every_cpu_counts():
    fake = machine((4, 4, 4, 0), cpus=(0, 1, 2, 3))
    choice = choose(fake, affinity=None, cpu_count=4)
    assert (choice.num_threads, choice.usable_cores, choice.idle_cores) == (3, 4, 3.0)


def test_unknown_load_falls_back_to_one_thread():
    fake = FakeMachine()  # no /proc/stat: macOS, Windows
    choice = choose(fake, affinity=None, cpu_count=8)
    assert choice == ThreadChoice(1, 8, None, choice.reason)
    assert "load is unknown" in choice.reason


def test_a_sample_without_ticks_is_an_unknown_load():
    fake = FakeMachine(start={0: (10, 10), 1: (10, 10)})  # the counters did not move
    assert idle_cores({0, 1}, fake.read_text, fake.sleep) is None
    assert choose(fake).num_threads == 1


def test_hypervisor_steal_and_iowait_are_counted_right():
    before = "cpu0 100 0 0 100 0 0 0 0 0 0\ncpu1 100 0 0 100 0 0 0 0 0 0\n"
    # cpu0: 4 ticks stolen by the hypervisor (busy); cpu1: 4 ticks of iowait (idle).
    after = "cpu0 100 0 0 100 0 0 0 4 0 0\ncpu1 100 0 0 100 4 0 0 0 0 0\n"
    readings = iter([before, after])
    assert idle_cores(None, lambda path: next(readings), lambda s: None) == 1.0


# ------------------------------------------------------------- cgroup quota
CG_V2 = {"/proc/self/cgroup": "0::/user.slice/job\n"}


@pytest.mark.parametrize("files, expected", [
    ({}, None),
    ({**CG_V2, "/sys/fs/cgroup/user.slice/job/cpu.max": "max 100000\n"}, None),
    ({**CG_V2, "/sys/fs/cgroup/user.slice/job/cpu.max": "150000 100000\n"}, 1.5),
    # The parent's quota binds the child.
    ({**CG_V2, "/sys/fs/cgroup/user.slice/job/cpu.max": "400000 100000\n",
      "/sys/fs/cgroup/user.slice/cpu.max": "200000 100000\n"}, 2.0),
    # A container that sees its own cgroup at the mount's root.
    ({"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/cpu.max": "50000 100000\n"}, 0.5),
    ({**CG_V2, "/sys/fs/cgroup/user.slice/job/cpu.max": "garbage\n"}, None),
    # cgroup v1: no quota (-1), then 3 cores.
    ({"/proc/self/cgroup": "3:cpu,cpuacct:/docker/abc\n", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
      "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"/proc/self/cgroup": "3:cpu,cpuacct:/docker/abc\n",
      "/sys/fs/cgroup/cpu/docker/abc/cpu.cfs_quota_us": "300000\n",
      "/sys/fs/cgroup/cpu/docker/abc/cpu.cfs_period_us": "100000\n"}, 3.0),
])
def test_cgroup_cpu_limit(files, expected):
    assert cgroup_cpu_limit(files.get) == expected


def test_a_quota_caps_the_threads_at_its_whole_cores():
    quota = {**CG_V2, "/sys/fs/cgroup/user.slice/job/cpu.max": "250000 100000\n"}
    fake = machine((4, 4, 4, 4), quota, cpus=(0, 1, 2, 3))
    choice = choose(fake, affinity=(0, 1, 2, 3), cpu_count=4)
    assert (choice.num_threads, choice.usable_cores) == (2, 2)
    assert "cgroup CPU quota 2.5 cores" in choice.reason


def test_one_usable_core_needs_no_sample():
    quota = {**CG_V2, "/sys/fs/cgroup/user.slice/job/cpu.max": "50000 100000\n"}  # half a core
    fake = machine((4, 4), quota)
    assert choose(fake).num_threads == 1
    assert fake.sleeps == []
    single = machine((4,), cpus=(0,))
    expected = ThreadChoice(1, 1, None, "1 usable core: 1 CPU in the affinity mask")
    assert choose(single, affinity=(0,), cpu_count=4) == expected
    assert single.sleeps == []


@pytest.mark.parametrize("bad", [0, -0.1, float("inf"), float("nan"), "0.04"])
def test_sample_seconds_is_validated(bad):
    with pytest.raises(ValueError, match="Invalid value of sample_seconds"):
        choose_num_threads(sample_seconds=bad)


# --------------------------------------------------------------- "auto" in the API
def test_auto_resolves_once_per_process_and_explicit_values_win(monkeypatch):
    calls = []

    def fake_choose():
        calls.append(1)
        return ThreadChoice(2, 2, 2.0, "fake")

    monkeypatch.setattr(threads, "choose_num_threads", fake_choose)
    threads._default_choice.cache_clear()
    try:
        assert threads.resolve_num_threads("auto") == 2
        assert threads.resolve_num_threads("auto") == 2
        assert calls == [1]  # sampled once, then kept
        assert threads.resolve_num_threads(3) == 3
        assert threads.resolve_num_threads(None) is None
        for bad in (0, -1, 2**31):
            with pytest.raises(ValueError, match=r"Invalid value of num_threads: expected 1 <= num_threads <= "):
                threads.resolve_num_threads(bad)
        with pytest.raises(ValueError, match="Invalid value of num_threads: expected 'auto', None or an int"):
            threads.resolve_num_threads("two")
        for bad in (1.5, 2.0, True, np.float64(2)):  # the rule of every scalar argument: never truncated
            with pytest.raises(TypeError, match="Invalid type of num_threads: expected an integer"):
                threads.resolve_num_threads(bad)
        assert threads.resolve_num_threads(np.int64(2)) == 2
    finally:
        threads._default_choice.cache_clear()


def test_models_take_the_default_unless_told(monkeypatch):
    pytest.importorskip("threadpoolctl")
    from pagedkv.models import PagedBackend

    monkeypatch.setattr(threads, "choose_num_threads", lambda: ThreadChoice(2, 2, 1.8, "fake"))
    threads._default_choice.cache_clear()
    try:
        assert PagedBackend(1, 1, 4, num_pages=2).num_threads == 2
        assert PagedBackend(1, 1, 4, num_pages=2, num_threads=1).num_threads == 1
        assert PagedBackend(1, 1, 4, num_pages=2, num_threads=None).num_threads is None
        assert threads.BlasThreadLimit("auto").num_threads == 2
        assert threads.BlasThreadLimit(3).num_threads == 3
    finally:
        threads._default_choice.cache_clear()


@pytest.mark.parametrize("batch, auto_threads", [(1, 1), (7, 1), (8, 2), (9, 2)])
def test_auto_runs_small_decode_steps_on_one_thread(monkeypatch, tmp_path, batch, auto_threads):
    """Under "auto" (2 threads here), decode steps of fewer than SMALL_BATCH_ROWS sequences run their
    products and attention on one thread; an explicit count is kept whatever the batch."""
    pytest.importorskip("gguf")
    pytest.importorskip("threadpoolctl")
    from _llama_support import tiny_llama_path

    from pagedkv import attention
    from pagedkv.models import LlamaModel, PagedBackend
    from pagedkv.models import llama as llama_module
    from pagedkv.models import paged_backend as backend_module
    from pagedkv.models.gguf_loader import load_llama_gguf

    assert threads.SMALL_BATCH_ROWS == 8
    monkeypatch.setattr(threads, "choose_num_threads", lambda: ThreadChoice(2, 2, 1.9, "fake"))
    threads._default_choice.cache_clear()
    seen = {"products": set(), "attention": set()}
    matmul, decode = llama_module._matmul.matmul, attention.decode

    class Matmul:  # the compiled module's attribute cannot be patched; the model's reference can
        kernel_info = staticmethod(llama_module._matmul.kernel_info)

        @staticmethod
        def matmul(*args, num_threads=None, **kwargs):
            seen["products"].add(num_threads)
            return matmul(*args, num_threads=num_threads, **kwargs)

    def spy_decode(*args, num_threads=None, **kwargs):
        seen["attention"].add(num_threads)
        return decode(*args, num_threads=num_threads, **kwargs)

    monkeypatch.setattr(llama_module, "_matmul", Matmul)
    monkeypatch.setattr(backend_module.attention, "decode", spy_decode)
    try:
        config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
        for setting, expected in (("auto", auto_threads), (2, 2)):
            model = LlamaModel(config, weights, num_threads=setting)
            backend = PagedBackend.for_config(model.config, 16, num_threads=setting)
            ids = list(range(batch))
            for seq_id in ids:
                backend.add_sequence(seq_id)
            model.forward(backend, ids, [[1, 2, 3]] * batch)  # prefill: not a decode step
            seen["products"].clear()
            model.forward(backend, ids, [[4]] * batch)
            assert seen == {"products": {expected}, "attention": {expected}}, setting
            seen["attention"].clear()
        backend.num_threads = 2  # a count set later ends the rule
        model.forward(backend, [0], [[5]])
        assert seen["attention"] == {2}
    finally:
        threads._default_choice.cache_clear()


def test_the_real_machine_gives_a_valid_choice_quickly():
    """On this machine (whatever its load): a count within the usable cores, reported with its reason."""
    import os
    import time

    start = time.perf_counter()
    choice = choose_num_threads()
    elapsed = time.perf_counter() - start
    assert 1 <= choice.num_threads <= choice.usable_cores
    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    assert choice.idle_cores is None or 0.0 <= choice.idle_cores <= len(mask)
    assert choice.reason
    assert elapsed < 5.0  # a 30 ms sample; generous for a loaded machine


def test_the_commands_report_the_thread_count_and_its_reason(monkeypatch, capsys):
    from pagedkv.commands._model_options import resolve_threads

    reason = "2 usable cores: 2 CPUs in the affinity mask; 0.1 idle in a 30 ms sample"
    monkeypatch.setattr(threads, "choose_num_threads", lambda: ThreadChoice(1, 2, 0.1, reason))
    threads._default_choice.cache_clear()
    try:
        assert resolve_threads("auto") == "auto"  # the model and backend resolve it (and its small-batch rule)
        assert capsys.readouterr().err == f"threads: 1 (auto: {reason}; --threads N sets it)\n"
        monkeypatch.setattr(threads, "choose_num_threads", lambda: ThreadChoice(2, 2, 1.9, reason))
        threads._default_choice.cache_clear()
        assert resolve_threads("auto") == "auto"
        assert capsys.readouterr().err == (f"threads: 2 (auto: {reason}; decode steps of fewer than 8 sequences "
                                           "on 1; --threads N sets it)\n")
        monkeypatch.setattr(threads, "_affinity", lambda: {0, 1})
        assert resolve_threads(2) == 2
        assert capsys.readouterr().err == "threads: 2 (--threads)\n"
        assert resolve_threads(99) == 99  # accepted, but the user learns it oversubscribes the CPUs
        assert capsys.readouterr().err == ("threads: 99 (--threads; more than the 2 usable CPUs: threads will "
                                           "share cores and run slower)\n")
    finally:
        threads._default_choice.cache_clear()
