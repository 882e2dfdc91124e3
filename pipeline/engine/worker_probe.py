"""A vLLM worker extension that shows what a multimodal engine did with its images, and which
model runner and speculator the worker runs (`runner_report`).

Set `language_model.engine.worker_extension_cls: moonserve.pipeline.engine.worker_probe.WorkerProbe`
and call through the LanguageModel's `collective_rpc` (a Serve handle):
`install_image_probe` once, then `image_probe_report` for what happened since the last report.
It wraps two methods of the loaded model in the worker: `embed_multimodal` (the vision tower and
projector: with `vision.handover: encoder_cache` an engine that found every image's output in the
store never calls it) and `embed_input_ids` (each prefill's token ids as the language model gets
them, and the rows it gets at the image positions).

Example (inside a Serve app whose engine has the extension):
    >>> lm = serve.get_deployment_handle("LanguageModel", app_name="moonserve")
    >>> lm.collective_rpc.remote("install_image_probe").result()
    >>> [report] = lm.collective_rpc.remote("image_probe_report").result()
    >>> report["encoder_calls"], report["prefills"][0]["input_ids"][:4]
"""

from __future__ import annotations


class WorkerProbe:
    """Mixed into vLLM's worker (`worker_extension_cls`); `self.model_runner` is the worker's."""

    def install_image_probe(self) -> None:
        model = self.model_runner.get_model()
        self.image_probe = {"encoder_calls": 0, "prefills": []}
        embed_multimodal, embed_input_ids = model.embed_multimodal, model.embed_input_ids

        def counted_embed_multimodal(*args, **kwargs):
            self.image_probe["encoder_calls"] += 1
            return embed_multimodal(*args, **kwargs)

        def recorded_embed_input_ids(input_ids, *args, **kwargs):
            embeds = embed_input_ids(input_ids, *args, **kwargs)
            is_multimodal = kwargs.get("is_multimodal")
            if is_multimodal is not None and bool(is_multimodal.any()):  # a chunk with images
                self.image_probe["prefills"].append({
                    "input_ids": input_ids.tolist(),
                    # float32 lists: exact for bfloat16 rows, and what an RPC reply carries.
                    "image_rows": embeds[is_multimodal].float().cpu().tolist()})
            return embeds

        model.embed_multimodal = counted_embed_multimodal
        model.embed_input_ids = recorded_embed_input_ids

    def image_probe_report(self) -> dict:
        """Encoder calls, and prefill chunks with image positions, since the last report."""
        report, self.image_probe = self.image_probe, {"encoder_calls": 0, "prefills": []}
        return report

    def runner_report(self) -> dict:
        """The worker's model runner (its classes, most derived first: vLLM's V1 and V2 runners
        are both named GPUModelRunner, in different modules), its speculator's class, the CUDA
        graph mode vLLM resolved, and the UUID of the worker's GPU."""
        import torch

        runner = self.model_runner
        speculator = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
        mode = runner.vllm_config.compilation_config.cudagraph_mode
        return {"model_runner_mro": [qualified(c) for c in type(runner).__mro__],
                "speculator": None if speculator is None else qualified(type(speculator)),
                "cudagraph_mode": None if mode is None else getattr(mode, "name", str(mode)),
                "gpu_uuid": str(torch.cuda.get_device_properties(self.device).uuid)
                if torch.cuda.is_available() else None}


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
