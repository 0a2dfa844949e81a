"""The rollout side's loader of published weight versions (`WeightLoader`): fetch, checksum,
decode, and LoRA adapters merged or attached. Apart from `streamrl.rollout.weights` (the
follower and its lock), which the stub policy uses without JAX.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import redis

from streamrl.config import LoraServing
from streamrl.model.lora import LoraConfig, attach_lora, merge_lora
from streamrl.model.spec import PyTree
from streamrl.model.weights import adapters_template, lora_config, params_from_bytes
from streamrl.names import Keys
from streamrl.weightsync import (
    WeightsError,
    check_checksum,
    describe,
    fetch_published,
    overlapped,
)
from streamrl.wire import Weights

__all__ = ["WeightLoader"]


class WeightLoader:
    """Published version -> serving params (runs on a thread).

    Full versions decode into `template`'s structure and become the base that later
    adapter-only versions apply to: merged into its kernels (`lora_serving` "merged":
    each version rewrites every adapted kernel, decoding runs at the plain model's speed)
    or attached beside them (`"attached"`: a version costs its own bytes, each decoding
    step two thin matmuls more per adapted layer; the engine's programs compile once more,
    lazily, for the attached structure). The checksum of a big version is checked while
    the bytes decode, on a second thread; decoded params are used only once it matched.
    """

    def __init__(
        self,
        client: redis.Redis | None,
        keys: Keys,
        template: PyTree,
        base: PyTree,
        lora_serving: LoraServing = "merged",
        *,
        weights_dir: Path | None,
    ) -> None:
        """`weights_dir`: where `dir` versions may be read from (RUN_DIR/weights); None:
        this worker reads Redis versions only."""
        self.client = client
        self.keys = keys
        self.weights_dir = weights_dir
        self.template = template
        self.base = base
        self.lora_serving = lora_serving
        self.base_version = -1  # -1: the checkpoint the worker started from
        self._adapter_templates: dict[LoraConfig, PyTree] = {}
        self._hasher = ThreadPoolExecutor(1)

    def __call__(self, msg: Weights, base_msg: Weights | None) -> PyTree:
        # Ready before they are swapped in (the engine decodes with the old params until
        # then, instead of waiting for a copy or merge at its next step).
        return jax.block_until_ready(self._load(msg, base_msg))

    def _load(self, msg: Weights, base_msg: Weights | None) -> PyTree:
        if msg.kind == "full":
            params = self._fetch_decode(msg, self.template)
            self.base, self.base_version = params, msg.version
            return params
        cfg = lora_config(msg.lora)
        if msg.base_version != self.base_version:
            if base_msg is None or base_msg.version != msg.base_version:
                raise WeightsError(
                    f"adapters of version {msg.version} apply to full version "
                    f"{msg.base_version}, which this worker has not seen"
                )
            self._load(base_msg, None)
        if cfg not in self._adapter_templates:
            self._adapter_templates[cfg] = adapters_template(self.template, cfg)
        adapters = self._fetch_decode(msg, self._adapter_templates[cfg])
        if self.lora_serving == "attached":
            return attach_lora(self.base, adapters, cfg)
        return merge_lora(self.base, adapters, cfg)

    def _fetch_decode(self, msg: Weights, template: PyTree) -> PyTree:
        data = fetch_published(msg, self.client, self.keys, self.weights_dir)
        where = describe(msg)
        checked = overlapped(self._hasher, msg.nbytes, check_checksum, data, msg.checksum, where)
        try:
            params = params_from_bytes(template, data)
        except WeightsError as err:
            checked()  # damaged bytes: the checksum says so more clearly
            raise WeightsError(f"{where}: {err}") from None
        checked()
        return params
