"""The host loop: builds a run from a TrainConfig, trains, evaluates, checkpoints, exports."""

import dataclasses
import errno
import functools
import os
import sys
import tempfile
import time
from collections.abc import Iterator

import jax

from jaxllmq import memory, peaks, runlock
from jaxllmq.checkpoint import Checkpointing
from jaxllmq.checkpoint_files import CheckpointError
from jaxllmq.data.pipeline import TokenBatches, to_global_arrays
from jaxllmq.dtypes import DTYPES
from jaxllmq.export import tokenizer_dir
from jaxllmq.generate import GenerateError, Sampler
from jaxllmq.log import RunLog
from jaxllmq.model import hf
from jaxllmq.model.architecture import load_model_config
from jaxllmq.optim import NonFiniteError, check_nonfinite, lr_schedule
from jaxllmq.parallel.mesh import batch_rows, make_mesh, replicated
from jaxllmq.plan import plan_for
from jaxllmq.preemption import Preemption
from jaxllmq.setting import SettingError
from jaxllmq.settings import TrainConfig
from jaxllmq.telemetry import Nvml, device_records
from jaxllmq.train_step import Batch, build


def check_output_dirs(cfg: TrainConfig) -> None:
    """Refuse an output directory that cannot be created or written, naming its flag, at start:
    --out_dir is first written after the last step. Nothing is left behind: the probe is a
    directory made and removed in the deepest part of the path that exists. Process 0 writes
    the export and the logs; every process writes checkpoints."""
    dirs = [("--checkpoint_dir", cfg.ckpt.checkpoint_dir)]
    if jax.process_index() == 0:
        log_dir = (os.path.dirname(cfg.log_file) or ".") if cfg.log_file else None
        dirs += [
            ("--out_dir", cfg.out_dir),
            ("--log_file", log_dir),
            ("--tensorboard_dir", cfg.tensorboard_dir),
        ]
    for flag, path in dirs:
        if not path:
            continue
        existing = os.path.abspath(path)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        try:
            if not os.path.isdir(existing):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            os.rmdir(tempfile.mkdtemp(dir=existing))
        except OSError as e:
            raise SettingError(
                f"{flag}: cannot write to {path} ({existing}: {e.strerror or e}); give a "
                "writable directory"
            ) from e


class Trainer:
    """Builds the mesh, model, optimizer, data and steps from a TrainConfig; `run` trains."""

    def __init__(self, cfg: TrainConfig, argv: list[str] | None = None):
        self.cfg = cfg
        check_output_dirs(cfg)
        # Before anything is written (the log, orbax's cleanup of its temporaries): the run's
        # output paths are this run's alone. Released when `run` ends, or here if setup fails.
        self.lock = runlock.for_run(cfg, argv or sys.argv)
        try:
            self._setup(argv)
        except BaseException:
            self.lock.release()
            raise

    def _setup(self, argv: list[str] | None) -> None:
        """Everything else: mesh, data, log, checkpoints (resumed), the compiled steps."""
        cfg = self.cfg
        m = cfg.mesh
        self.mesh = make_mesh(
            m.gpus, tensor_parallel=m.tensor_parallel, data_parallel=m.data_parallel
        )
        n_dev = self.mesh.size
        self.model_cfg = load_model_config(cfg.model.model)
        # Before any data or weights are read: a --seq_len past the model's positions, or a
        # model too large for these devices, is refused.
        cfg.data.check_seq_len(self.model_cfg, cfg.model.model)
        # What build will run; a tensor-parallel size the model cannot take is refused here.
        self.plan = plan_for(
            self.model_cfg,
            cfg.model,
            self.mesh,
            zero_level=m.zero_level,
            documents_per_window=cfg.data.documents_per_window,
        )
        memory.check_training_fits(
            self.model_cfg,
            f"--model={cfg.model.model}",
            model_dtype=cfg.model.model_dtype,
            opt_m_dtype=cfg.optim.opt_m_dtype,
            opt_v_dtype=cfg.optim.opt_v_dtype,
            offload=cfg.model.offload.any,
            devices=list(self.mesh.devices.flat),
        )
        d = cfg.data
        self.rows = batch_rows(self.mesh, d.batch_size)
        self.train_data = TokenBatches(
            d.train_files,
            seq_len=d.seq_len,
            batch_size=self.rows,
            grad_accumulation=d.grad_accumulation,
            seed=d.train_seed,
            eos_id=d.document_eos_id,
            documents_per_window=d.documents_per_window,
        )
        eval_data = self._eval_batches()  # an eval set too small for one batch: refused now
        # Before any device work: samples without a tokenizer are refused at start.
        self.sampler = self._make_sampler() if cfg.sample_every_n_steps > 0 else None
        self.total_steps = cfg.steps or cfg.epochs * self.train_data.steps_per_epoch
        try:  # --warmup and --cooldown against the run's length (--epochs: known only now)
            lr_schedule(cfg.optim, self.total_steps)
        except ValueError as e:
            raise SettingError(str(e)) from e
        self.tokens_per_step = d.seq_len * self.rows * d.grad_accumulation
        kind = self.mesh.devices.flat[0].device_kind  # MFU against its peaks, none if unknown
        peak = lambda dtype: (peaks.peak_flops(kind, dtype) or 0.0) * n_dev
        self.log = RunLog(
            cfg.log_file,
            total_steps=self.total_steps,
            flops_per_token=self.model_cfg.flops_per_token(d.seq_len),
            peak_flops=peak("bfloat16"),
            peak_flops_fp8=peak("fp8") if cfg.model.linear_dtype else 0.0,
            is_main=jax.process_index() == 0,
            tensorboard_dir=cfg.tensorboard_dir,
            wandb_project=cfg.wandb_project,
            run_name=cfg.name,
            run_config=dataclasses.asdict(cfg),
        )
        # NVML only where this process logs: other processes' telemetry would not be written.
        self.nvml = Nvml() if self.log.is_main else None
        self.log.record("cmd", 0, argv=argv or sys.argv)
        self.log.record("options", 0, **dataclasses.asdict(cfg))
        self.log.info(0, self.plan.describe(), plan=self.plan.to_record())
        # Every token id inside the model's vocab, and tokens to train on, before device work.
        log_info = functools.partial(self.log.info, 0)
        vocab = self.model_cfg.vocab_size
        self.train_data.validate(vocab, note=log_info)
        self.eval_scored = eval_data is not None and (
            eval_data.validate(vocab, need_scored=False, note=log_info) > 0
        )
        for note in self.lock.notes:
            self.log.info(0, note)
        # Before the build: a checkpoint that cannot be resumed is refused before device work.
        self.ckpt = Checkpointing(
            cfg.ckpt,
            run={"argv": argv or sys.argv, "config": dataclasses.asdict(cfg)},
            model=self.model_cfg.to_hf_dict(),
            info=lambda message: self.log.info(0, message),
        )
        if self.ckpt.resume is not None and cfg.ckpt.new_data:
            self.log.info(0, "--new_data: the data pipeline starts from its beginning")
        elif self.ckpt.resume is not None:
            self._resume_data()  # a data position that does not fit is refused before the build

        spec = cfg.model
        self.compiled = build(
            self.model_cfg,
            spec,
            cfg.optim,
            self.plan,
            mesh=self.mesh,
            total_steps=self.total_steps,
            seed=d.train_seed,
            z_loss=cfg.z_loss,
        )
        self.state = self.compiled.state
        if self.ckpt.resume is not None:
            self._resume()
        self.batch_sharding = self.compiled.batch_sharding
        self.log.record(
            "model",
            0,
            name=spec.model,
            architecture=self.model_cfg.architecture,
            params=self.model_cfg.num_params(),
            config=self.model_cfg.to_hf_dict(),
            devices=n_dev,
            device_kind=jax.devices()[0].device_kind,
            processes=jax.process_count(),
            jax_version=jax.__version__,
            kernels=self.plan.kernels,  # what runs: --kernels resolved, fallbacks applied
        )
        self._log_gpu(0)
        self.log.record(
            "dataset",
            0,
            train_files=list(d.train_files),
            windows=self.train_data.num_windows,
            steps_per_epoch=self.train_data.steps_per_epoch,
            vocab_size=self.train_data.vocab_size,
            eval_files=list(d.eval_files),
        )

    def _resume(self) -> None:
        """Restore the checkpoint --continue chose: state (onto this run's shardings), the data
        position (unless --new_data) and the outlier history."""
        self.state = self.compiled.state = self.ckpt.restore(self.compiled.state)
        self._resume_data()  # again: restore may have fallen back to an older checkpoint
        self.log.load_state_dict(self.ckpt.resume.log)

    def _resume_data(self) -> None:
        if self.cfg.ckpt.new_data:
            return
        try:
            self.train_data.set_state(self.ckpt.resume.data)
        except ValueError as e:
            raise CheckpointError(f"--continue: {e}") from e

    def _save(self, step: int) -> None:
        """Start an asynchronous checkpoint of the state after `step`."""
        held = self.ckpt.save(
            step, self.state, data=self.train_data.get_state(), log=self.log.state_dict()
        )
        self.log.record("checkpoint", step, path=self.ckpt.path(step), blocking_ms=1000 * held)

    def _eval_batches(self) -> Iterator[Batch] | None:
        d = self.cfg.data
        if not d.eval_files:
            return None
        return TokenBatches(
            d.eval_files,
            seq_len=d.seq_len,
            batch_size=self.rows,
            grad_accumulation=1,
            seed=d.eval_seed,
            shuffle=False,
            repeat=False,
            flag_name="--eval_file",
            eos_id=d.document_eos_id,
            documents_per_window=d.documents_per_window,
        )

    def evaluate(self, max_batches: int | None) -> tuple[float, int] | None:
        """Mean loss over the eval set (from its start), at most `max_batches` batches, and the
        tokens scored; None without an eval set with scored tokens, NaN loss if the batches read
        score none."""
        if not self.eval_scored:
            return None
        batches = self._eval_batches()
        ce, tokens = 0.0, 0
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            c, t = self.compiled.eval_step(
                self.state.params, to_global_arrays(batch, self.batch_sharding)
            )
            ce, tokens = ce + float(c), tokens + int(t)
        return (ce / tokens if tokens else float("nan")), tokens

    def _log_step(self, step: int, metrics: dict, t_prev: float) -> float:
        """Fetch a step's metrics (waiting for that step only) and log them; returns the time it
        finished by. The clock is read after the fetch: the step is done only then."""
        m = jax.device_get(metrics)
        now = time.perf_counter()
        duration_s = now - t_prev
        self.log.step(
            step,
            loss=float(m["loss"]),
            norm=float(m["norm"]),
            lr=float(m["lr"]),
            tokens=self.tokens_per_step,
            duration_ms=1000 * duration_s,
            trained_tokens=int(m["tokens"]),
            lse_max=float(m["lse_max"]),
            lse_mean=float(m["lse_mean"]),
        )
        if int(m["nonfinite"]) > 0:
            self.log.info(step, f"step {step}: non-finite gradients, update skipped")
        try:
            check_nonfinite(self.cfg.optim, step, int(m["nonfinite"]), int(m["nonfinite_total"]))
        except NonFiniteError as e:
            raise NonFiniteError(f"{e} {self.ckpt.resume_advice()}") from None
        every = self.cfg.log_gpu_util
        if every > 0 and step % every == 0:
            self._log_gpu(step)
        if step == self.first_step:
            self.log.info(step, f"step {step} took {duration_s:.1f} s, compilation included")
        return now

    def _log_gpu(self, step: int) -> None:
        """A `gpu` record: each local device's kind, memory (in use, peak, limit) and NVML fields.
        Host-side reads only (allocator stats, NVML): no device sync."""
        if self.log.is_main:
            self.log.record("gpu", step, devices=device_records(jax.local_devices(), self.nvml))

    def _make_sampler(self) -> Sampler:
        cfg = self.cfg
        source = tokenizer_dir(cfg.model.model, cfg.data.train_files)
        if source is None:
            raise SettingError(
                "--sample_every_n_steps needs a tokenizer: no tokenizer.json in --model's "
                "directory nor beside --train_file's shards"
            )
        try:
            return Sampler(
                self.model_cfg,
                source,
                cfg.sample_prompts,
                max_new_tokens=cfg.sample_max_new_tokens,
                dtype=DTYPES[cfg.model.compute_dtype],
                out_sharding=replicated(self.mesh),
                chat=cfg.sample_chat,
            )
        except GenerateError as e:
            raise SettingError(f"--sample_every_n_steps: {e}") from e

    def _sample(self, step: int) -> None:
        """Log greedy continuations of the sample prompts by the current params."""
        for prompt, text in self.sampler(self.compiled.weights(self.state.params)):
            self.log.sample(step, prompt=prompt, text=text)

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.eval_every_n_steps
        return self.eval_scored and every > 0 and step % every == 0

    def run(self) -> dict[str, float]:
        """Train to the last step, evaluate on the whole eval set, export. Returns final losses.

        With --checkpoint_dir, SIGTERM or SIGINT ends the run after the current step with a
        checkpoint (the result then has `stopped_at`); every save started is complete on disk
        before this returns or raises.
        """
        preemption = Preemption()
        if self.ckpt.saving:
            preemption.install()
        try:
            return self._run(preemption)
        finally:
            preemption.uninstall()
            self.ckpt.close()
            self.lock.release()

    def _run(self, preemption: Preemption) -> dict[str, float]:
        pending = None  # (step, metrics) dispatched but not yet logged
        t_prev = time.perf_counter()
        self.first_step = int(self.state.step) + 1
        for step in range(self.first_step, self.total_steps + 1):
            batch = to_global_arrays(next(self.train_data), self.batch_sharding)
            self.state, metrics = self.compiled.train_step(self.state, batch)
            self.ckpt.check_saves(step)  # while the step runs: did a background save fail?
            if pending is not None:
                # Log step t-1 while step t runs: the fetch waits for t-1 only.
                t_prev = self._log_step(*pending, t_prev)
            pending = (step, metrics)
            evaluate = self._eval_due(step) and step < self.total_steps
            every = self.cfg.sample_every_n_steps
            sample = every > 0 and step % every == 0
            stop = preemption.reached(step)
            save = stop or self.ckpt.due(step)
            if evaluate or save or sample:
                # Evaluate and checkpoint between steps, so neither the step times nor the eval
                # overlap, and a checkpoint's outlier history holds its own step.
                self._log_step(*pending, t_prev)
                pending = None
                if evaluate:
                    loss, tokens = self.evaluate(self.cfg.eval_num_steps)
                    self.log.eval(step, loss=loss, tokens=tokens)
                if sample:
                    self._sample(step)
                if save:
                    self._save(step)  # returns once the state is in host memory
                t_prev = time.perf_counter()
            if stop:
                self.ckpt.close()
                saved = self.ckpt.last_saved == step  # else it failed (--ckpt_failure=continue)
                self.log.info(
                    step,
                    f"stopped by {preemption.signal} after step {step}: checkpoint "
                    f"{self.ckpt.path(step)} {'is complete' if saved else 'could not be saved'}; "
                    "resume with --continue=latest",
                )
                self.log.close()
                return {"train_loss": float(metrics["loss"]), "stopped_at": step}
        last_loss = float("nan")
        if pending is not None:
            self._log_step(*pending, t_prev)
            last_loss = float(pending[1]["loss"])
        step = int(self.state.step)
        if self.cfg.ckpt.save_training_state and not self.ckpt.has(step):
            self._save(step)  # written while the final evaluation and the export run
        result = {"train_loss": last_loss}
        final = self.evaluate(None)
        if final is not None:
            self.log.eval(self.total_steps, loss=final[0], tokens=final[1])
            result["eval_loss"] = final[0]
        if self.cfg.out_dir:
            self.export(self.cfg.out_dir)
        self.log.close()
        return result

    def export(self, out_dir: str) -> None:
        """Write the model in HF format, with the tokenizer files of the source model or data."""
        hf.save_hf(
            out_dir,
            self.model_cfg,
            self.state.params,
            tokenizer_dir=tokenizer_dir(self.cfg.model.model, self.cfg.data.train_files),
            write=jax.process_index() == 0,
        )
        self.log.info(int(self.state.step), f"exported the model to {out_dir}")


def run(cfg: TrainConfig, argv: list[str] | None = None) -> dict[str, float]:
    """Train as the config says; returns the final train (and eval) loss."""
    return Trainer(cfg, argv).run()
