"""Device assignment, config cross-filling and validation, written configs, and --dry-run."""

import importlib.util
import re
import socket
from pathlib import Path

import pytest

from tandem.config.loader import ConfigError, build_config
from tandem.inference.config import InferenceConfig
from tandem.launch.cli import main
from tandem.launch.config import RLConfig
from tandem.launch.devices import assign_devices
from tandem.launch.plan import INFERENCE_MODULE, ORCHESTRATOR_MODULE, TRAINER_MODULE, plan_run
from tandem.models.tiny import build_tiny_model
from tandem.orchestrator.config import OrchestratorConfig
from tandem.trainer.rl.config import RLTrainerConfig


def gpus(n: int) -> list[str]:
    return [str(i) for i in range(n)]


@pytest.mark.parametrize(
    ("visible", "inference", "trainer", "nproc", "colocated"),
    [
        (0, [[]], [], 1, False),
        (1, [["0"]], ["0"], 1, True),
        (2, [["0"]], ["1"], 1, False),
        (4, [["0"], ["1"]], ["2", "3"], 2, False),
    ],
)
def test_default_assignment(
    visible: int, inference: list[list[str]], trainer: list[str], nproc: int, colocated: bool
) -> None:
    a = assign_devices(gpus(visible), None, None, None, None)
    assert (a.inference, a.trainer, a.trainer_nproc, a.colocated) == (inference, trainer, nproc, colocated)
    assert a.on_gpu == (visible > 0)


def test_configured_assignment() -> None:
    assert assign_devices(gpus(4), None, None, 1, None).inference == [["0", "1"]]
    a = assign_devices(gpus(4), ["3"], None, None, None)
    assert (a.inference, a.trainer, a.trainer_nproc) == ([["3"]], ["0", "1", "2"], 3)
    a = assign_devices(gpus(2), ["0"], ["0", "1"], None, None)
    assert a.colocated and a.trainer_nproc == 2
    cpu = assign_devices([], None, None, 2, 4)
    assert (cpu.inference, cpu.trainer, cpu.trainer_nproc) == ([[], []], [], 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (gpus(2), ["5"], None, None, None),
            "deployment.inference_gpus: GPU(s) 5 not visible (visible: 0, 1)",
        ),
        ((gpus(4), None, None, None, 3), "deployment.trainer_nproc: 3 rank(s) on 2 trainer GPU(s)"),
        ((gpus(4), ["0", "1", "2"], ["3"], 2, None), "2 server(s) cannot split 3 inference GPU(s)"),
        ((gpus(2), ["0"], [], None, None), "the trainer would run on CPU while the other side has GPUs"),
        ((gpus(2), ["0", "0"], ["1"], None, None), "a GPU is listed twice"),
    ],
)
def test_assignment_errors(args: tuple, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        assign_devices(*args)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def config(tmp_path: Path, **overrides: object) -> RLConfig:
    base = [("model.name", "tiny"), ("run_dir", str(tmp_path / "run")), ("max_steps", 3), ("seq_len", 128)]
    base += [("orchestrator.sampling.max_tokens", 16)]
    return build_config(RLConfig, overrides=base + list(overrides.items()))


def test_cross_filling_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = config(
        tmp_path, **{"deployment.inference_servers": 2, "deployment.trainer_nproc": 2, "resume": True}
    )
    plan = plan_run(cfg, [], cores=9)
    run = tmp_path / "run"

    assert [c.port for c in plan.inference] == [8000, 8001]
    assert plan.orchestrator.servers == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert plan.orchestrator.num_ranks == 2
    assert {plan.orchestrator.run_dir, plan.trainer.run_dir, *(c.run_dir for c in plan.inference)} == {run}
    assert plan.orchestrator.resume and plan.trainer.resume
    assert plan.orchestrator.max_steps == plan.trainer.max_steps == 3  # top level, not the sections' defaults
    assert (
        plan.orchestrator.seq_len == plan.trainer.seq_len == 128
        and plan.inference[0].engine.max_model_len == 128
    )
    assert plan.trainer.model.name == plan.inference[1].model.name == "tiny"
    assert plan.inference[0].engine.gpu_memory_utilization == 0.85  # not colocated on CPU

    specs = {s.name: s for s in plan.specs()}
    assert list(specs) == ["inference_0", "inference_1", "trainer", "orchestrator"]
    trainer = specs["trainer"].argv
    assert trainer[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    assert trainer[6:] == ["tandem.trainer.rl.cli", "@", str(run / "configs" / "trainer.toml")]
    assert all(s.env["CUDA_VISIBLE_DEVICES"] == "" for s in specs.values())
    # 9 cores over 2 servers + 2 trainer ranks; the orchestrator keeps the default
    assert [s.env.get("OMP_NUM_THREADS") for s in specs.values()] == ["2", "2", "2", None]
    assert plan_run(config(tmp_path, **{"deployment.cpu_threads": 3}), [], cores=9).cpu_threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert plan_run(cfg, [], cores=9).cpu_threads is None  # the user's own setting is inherited
    assert specs["inference_1"].health_url == "http://127.0.0.1:8001/health"
    assert specs["inference_0"].role == "service" and specs["trainer"].role == "job"


def test_orchestrator_packs_for_the_trainers_context_parallelism(tmp_path: Path) -> None:
    parallel = {"trainer.parallel.cp": 2, "trainer.parallel.cp_style": "ring", "deployment.trainer_nproc": 4}
    orchestrator = plan_run(config(tmp_path, **parallel), []).orchestrator
    assert (orchestrator.num_ranks, orchestrator.cp, orchestrator.width_multiple) == (4, 2, 4)


def test_monitoring_and_seeded_sampling_reach_their_processes(tmp_path: Path) -> None:
    """[monitor] flows to the orchestrator (it writes the W&B run), which learns where the resolved
    run config is; seeded sampling turns the servers' prefix cache off unless it was set."""
    wandb = {"monitor.wandb.project": "p", "monitor.wandb.mode": "offline"}
    plan = plan_run(config(tmp_path, **wandb, **{"orchestrator.seeded_sampling": True}), [])
    assert plan.orchestrator.monitor.wandb is not None and plan.orchestrator.monitor.wandb.project == "p"
    assert plan.config.orchestrator.monitor == plan.orchestrator.monitor  # the resolved whole says so too
    orchestrator = next(s for s in plan.specs() if s.name == "orchestrator")
    assert orchestrator.env["TANDEM_RUN_CONFIG"] == str(tmp_path / "run" / "configs" / "rl.toml")
    assert plan.inference[0].engine.prefix_caching is False
    assert plan_run(config(tmp_path), []).inference[0].engine.prefix_caching is True
    kept = {"orchestrator.seeded_sampling": True, "inference.engine.prefix_caching": True}
    assert plan_run(config(tmp_path, **kept), []).inference[0].engine.prefix_caching is True


def test_gpu_placement_and_colocation(tmp_path: Path) -> None:
    plan = plan_run(config(tmp_path), ["0"])
    specs = {s.name: s for s in plan.specs()}
    assert (
        specs["inference"].env["CUDA_VISIBLE_DEVICES"] == specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "0"
    )
    assert specs["orchestrator"].env["CUDA_VISIBLE_DEVICES"] == ""
    assert plan.inference[0].engine.gpu_memory_utilization == 0.3
    assert plan.inference[0].vllm.gpu_memory_utilization == 0.3
    assert specs["trainer"].argv[1:3] == ["-m", "tandem.trainer.rl.cli"]

    explicit = plan_run(config(tmp_path, **{"inference.engine.gpu_memory_utilization": 0.5}), ["0"])
    assert explicit.inference[0].engine.gpu_memory_utilization == 0.5

    split = plan_run(config(tmp_path, **{"inference.api_key": "k"}), gpus(4))
    specs = {s.name: s for s in split.specs()}
    assert [specs[n].env["CUDA_VISIBLE_DEVICES"] for n in ("inference_0", "inference_1", "trainer")] == [
        "0",
        "1",
        "2,3",
    ]
    assert "--nproc-per-node=2" in specs["trainer"].argv and split.orchestrator.num_ranks == 2
    assert split.inference[0].engine.gpu_memory_utilization == 0.85
    assert split.orchestrator.client.api_key == "k"


def test_prefill_servers_compute_the_others_prompts(tmp_path: Path) -> None:
    """deployment.prefill_servers = 1 of 3: the last server computes prompts for the first two,
    takes weights with them, and gets no rollouts."""
    plan = plan_run(
        config(tmp_path, **{"deployment.inference_servers": 3, "deployment.prefill_servers": 1}), []
    )
    urls = [f"http://127.0.0.1:{c.port}" for c in plan.inference]
    assert [c.prefill.servers for c in plan.inference] == [[urls[2]], [urls[2]], []]
    assert (plan.orchestrator.servers, plan.orchestrator.prefill_servers) == (urls[:2], [urls[2]])
    assert plan.trainer.weights.num_servers == 3
    assert [c.weights.server_index for c in plan.inference] == [0, 1, 2]
    assert [s.name for s in plan.specs()][:3] == ["inference_0", "inference_1", "inference_2"]
    assert [c.prefill.transport for c in plan.inference[:2]] == ["shared", "shared"]
    assert {c.backend for c in plan.inference} == {"native"}
    on_gpus = {
        "deployment.inference_servers": 3,
        "deployment.prefill_servers": 1,
        "deployment.inference_gpus": ["0", "1", "2"],
        "deployment.trainer_gpus": ["3"],
    }
    specs = {s.name: s for s in plan_run(config(tmp_path, **on_gpus), gpus(4)).specs()}
    visible = [specs[f"inference_{i}"].env["CUDA_VISIBLE_DEVICES"] for i in range(3)]
    assert visible == ["0,2", "1,2", "2"]  # a decode server maps its prefill server's buffers (CUDA IPC)
    over_http = plan_run(config(tmp_path, **on_gpus, **{"inference.prefill.transport": "http"}), gpus(4))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in over_http.specs()][:3] == ["0", "1", "2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"deployment.prefill_servers": 1},
            "deployment.prefill_servers = 1 of 1 inference server(s) leaves none",
        ),
        (
            {
                "deployment.inference_servers": 2,
                "deployment.prefill_servers": 1,
                "orchestrator.seeded_sampling": True,
            },
            "deployment.prefill_servers needs the prefix cache, which is off",
        ),
        (
            {
                "deployment.inference_servers": 2,
                "deployment.prefill_servers": 1,
                "inference.prefill.servers": ["http://x:1"],
            },
            "inference.prefill.servers = ['http://x:1'] conflicts with ['http://127.0.0.1:8001'], which the "
            "launcher derives from deployment.prefill_servers",
        ),
        (
            {"deployment.inference_servers": 2, "deployment.prefill_servers": 1, "inference.backend": "vllm"},
            "deployment.prefill_servers needs the native engine; inference.backend is 'vllm'",
        ),
        (
            {"orchestrator.prefill_servers": ["http://x:1"]},
            "orchestrator.prefill_servers = ['http://x:1'] conflicts with [], which the launcher derives from "
            "deployment.prefill_servers",
        ),
        ({"orchestrator.batch_size": 10, "orchestrator.group_size": 4}, "batch_size (10) must be a multiple"),
        ({"seq_len": 16}, "seq_len (16) must exceed sampling.max_tokens (16)"),
        (
            {"orchestrator.servers": ["http://x:1"]},
            "orchestrator.servers = ['http://x:1'] conflicts with ['http://127.0.0.1:8000'], which the "
            "launcher derives from inference.port / deployment.inference_ports; set that instead",
        ),
        ({"trainer.run_dir": "elsewhere"}, "trainer.run_dir = 'elsewhere' conflicts with"),
        ({"orchestrator.num_ranks": 4}, "derives from deployment.trainer_nproc"),
        (
            {"trainer.parallel.cp": 2},
            "cp (2) must divide num_ranks (1): the trainer's context-parallel groups",
        ),
        ({"orchestrator.max_steps": 9}, "orchestrator.max_steps (9) and trainer.max_steps (3) differ"),
        ({"model.name": ""}, "model.name is empty"),
        ({"trainer.model.name": "other"}, "same checkpoint"),
        (
            {"weights.transport": "filesystem", "trainer.weights.keep": 1},
            "trainer.weights.keep (1) must exceed",
        ),
        (
            {"trainer.weights.transport": "filesystem"},
            "trainer.weights.transport = 'filesystem' conflicts with 'auto'",
        ),
        ({"inference.weights.port": 3}, "inference.weights.port = 3 conflicts with"),
        ({"deployment.shutdown_grace_s": 60}, "deployment.shutdown_grace_s"),
        ({"deployment.inference_ports": [9000, 9001]}, "2 port(s) for 1 inference server"),
        ({"deployment.colour": True}, "unknown key 'deployment.colour'"),
        (
            {"trainer.lora.enabled": True, "inference.engine.quantization": "fp8"},
            "trainer.lora with inference.engine.quantization = 'fp8': the native engine merges adapters",
        ),
    ],
)
def test_validation_is_one_clear_line(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        plan_run(config(tmp_path, **overrides), [])
    assert "\n" not in str(error.value)


def test_weight_transport_reaches_every_process(tmp_path: Path) -> None:
    plan = plan_run(config(tmp_path, **{"deployment.inference_servers": 2, "weights.bucket_mb": 64}), [])
    sections = [*plan.inference, plan.orchestrator, plan.trainer]
    assert {(s.weights.transport, s.weights.host, s.weights.port, s.weights.bucket_mb) for s in sections} == {
        ("auto", "127.0.0.1", plan.config.weights.port, 64)
    }
    assert plan.config.weights.port > 0 and plan.trainer.weights.num_servers == 2
    assert [c.weights.server_index for c in plan.inference] == [0, 1]
    given = plan_run(config(tmp_path, **{"weights.port": 29123}), [])
    assert given.trainer.weights.port == given.inference[0].weights.port == 29123
    on_disk = plan_run(config(tmp_path, **{"weights.transport": "filesystem"}), [])
    assert on_disk.trainer.weights.transport == "filesystem" and on_disk.trainer.weights.port == 0


@pytest.mark.parametrize(
    ("visible", "overrides", "message"),
    [
        (1, {"weights.transport": "broadcast"}, "inference server 0 shares GPU 0 with trainer rank 0"),
        (
            2,
            {"weights.transport": "colocated"},
            "inference server 0 (GPU 0) shares no GPU with the trainer (1)",
        ),
        (
            2,
            {
                "deployment.inference_gpus": ["0", "1"],
                "deployment.inference_servers": 1,
                "deployment.trainer_gpus": ["0"],
            },
            "inference server 0 has 2 GPUs; the in-memory transports feed one GPU per server",
        ),
    ],
)
def test_transport_the_devices_cannot_carry(
    visible: int, overrides: dict, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_run(config(tmp_path, **overrides), gpus(visible))
    plan_run(config(tmp_path, **{**overrides, "weights.transport": "filesystem"}), gpus(visible))


def test_written_configs_load_back(tmp_path: Path) -> None:
    plan = plan_run(config(tmp_path, **{"deployment.inference_servers": 2}), [])
    plan.write_configs()
    d = tmp_path / "run" / "configs"
    assert sorted(p.name for p in d.iterdir()) == [
        "inference_0.toml",
        "inference_1.toml",
        "orchestrator.toml",
        "rl.toml",
        "trainer.toml",
    ]
    assert build_config(InferenceConfig, [d / "inference_1.toml"]) == plan.inference[1]
    assert build_config(OrchestratorConfig, [d / "orchestrator.toml"]) == plan.orchestrator
    assert build_config(RLTrainerConfig, [d / "trainer.toml"]) == plan.trainer
    again = plan_run(build_config(RLConfig, [d / "rl.toml"]), [])  # the saved run re-launches unchanged
    assert (again.inference, again.orchestrator, again.trainer) == (
        plan.inference,
        plan.orchestrator,
        plan.trainer,
    )


def test_dry_run_prints_plan_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    # a local model: preflight asks the hub about a hub name (none answers here)
    model = build_tiny_model(
        out=tmp_path / "tiny", num_layers=1, hidden_size=32, head_dim=8, intermediate_size=64
    )
    toml = tmp_path / "rl.toml"
    toml.write_text(f'run_dir = "{tmp_path / "run"}"\nmax_steps = 2\n[model]\nname = "{model}"\n')
    main(["@", str(toml), "--deployment.trainer_nproc", "2", "--resume", "--dry-run"])
    out = capsys.readouterr().out

    resolved = build_config(RLConfig, [write(tmp_path / "resolved.toml", out)])  # a valid config file
    assert resolved.orchestrator.num_ranks == 2 and resolved.trainer.resume and resolved.max_steps == 2
    assert "# commands (CPU only)" in out
    assert (
        "#   [trainer] CUDA_VISIBLE_DEVICES=''" in out
        and "--nproc-per-node=2 -m tandem.trainer.rl.cli" in out
    )
    assert "-m tandem.inference.cli @" in out and "-m tandem.orchestrator.cli @" in out
    assert not (tmp_path / "run").exists()

    main(
        [
            "@",
            str(toml),
            "--deployment.inference_servers",
            "3",
            "--deployment.prefill_servers",
            "1",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert (
        "# prefill servers (no rollouts; the other servers take their prompts from them): http://127.0.0.1:"
        in out
    )
    again = plan_run(build_config(RLConfig, [write(tmp_path / "again.toml", out)]), [])  # plans as it reads
    assert again.orchestrator.prefill_servers == [f"http://127.0.0.1:{again.inference[2].port}"]


def test_cli_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--model.name", "m", "--orchestrator.batch_size", "7", "--dry-run"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("rl: error: invalid config: ") and "batch_size (7)" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("module", [INFERENCE_MODULE, ORCHESTRATOR_MODULE, TRAINER_MODULE])
def test_launched_modules_run_as_main(module: str) -> None:
    """`python -m MODULE` must call main(); a module without the guard would exit 0 doing nothing."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} is missing"
    assert 'if __name__ == "__main__":' in Path(spec.origin).read_text(), f"{module} lacks a __main__ guard"


def test_example_config_plans() -> None:
    example = Path(__file__).parents[2] / "examples" / "reverse_text" / "rl.toml"
    plan = plan_run(build_config(RLConfig, [example]), [])
    assert plan.orchestrator.servers == [f"http://127.0.0.1:{plan.inference[0].port}"]


def test_refuses_missing_model_used_run_dir_and_taken_port(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit):
        main(["--model.name", str(tmp_path / "nope"), "--run_dir", str(tmp_path / "run")])
    assert ": no such directory" in capsys.readouterr().err

    base = ["--model.name", "m", "--run_dir", str(tmp_path / "run"), "--deployment.inference_servers", "1"]
    (tmp_path / "run" / "rollouts" / "step_0").mkdir(parents=True)
    (tmp_path / "run" / "rollouts" / "step_0" / "READY").touch()
    with pytest.raises(SystemExit) as exit_info:
        main(base)
    assert exit_info.value.code == 2
    assert (
        "already holds rollouts up to step 0: pass --resume to continue that run (from step 0"
        in capsys.readouterr().err
    )

    # (a local model: in a run_dir that exists the ports are checked after the lock, so after every
    # other check, the hub's too, which no hub answers here)
    model = build_tiny_model(
        out=tmp_path / "tiny", num_layers=1, hidden_size=32, head_dim=8, intermediate_size=64
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit):
            main([*base, "--model.name", str(model), "--resume", "--inference.port", str(port)])
    err = capsys.readouterr().err
    assert f"rl: error: port {port} on 127.0.0.1 is taken" in err and err.count("\n") == 1
    assert not (tmp_path / "run" / "configs").exists(), "nothing is written or started after a failed check"


def test_a_job_exiting_0_before_its_share_is_done_is_told_from_one_that_finished(tmp_path: Path) -> None:
    """What the launcher asks when the orchestrator or the trainer exits 0 while the other runs
    (the other waited rollout_timeout_s or weights.wait_timeout for what never came)."""
    checks = {s.name: s.check_done for s in plan_run(config(tmp_path), []).specs()}
    orchestrator, trainer, run = checks["orchestrator"], checks["trainer"], tmp_path / "run"
    assert orchestrator is not None and trainer is not None and checks["inference"] is None
    assert orchestrator() == (
        "before writing the rollouts of step 2 (the last written: none); the trainer would have waited "
        "trainer.rollout_timeout_s=600 for them"
    )
    assert trainer() == (
        "before publishing weights/step_3 (the newest: none); the orchestrator would have waited "
        "weights.wait_timeout=3600 for them"
    )
    for marker in ("rollouts/step_1/READY", "weights/step_2/STABLE"):
        (run / marker).parent.mkdir(parents=True)
        (run / marker).write_text("{}")
    assert "(the last written: step 1)" in orchestrator() and "(the newest: step_2)" in trainer()

    (run / "rollouts" / "step_2").mkdir()
    (run / "rollouts" / "step_2" / "READY").write_text("{}")
    assert orchestrator() is None  # every step written: the trainer trains the rest
    (run / "rollouts" / "step_2" / "READY").unlink()
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    assert orchestrator() is None and trainer() is None  # a resume with every step trained already
