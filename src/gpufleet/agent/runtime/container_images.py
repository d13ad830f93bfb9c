"""The node's local container images, for heartbeats (DD9) and pre-pulls the controller asks for.

:class:`ImageReporter` caches the engine's image list (:meth:`.ContainerEngine.images`) and
pulls images ahead of the jobs that need them, in the background; the pull a job's own start
makes is :meth:`.ContainerRuntime.ensure_image`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from gpufleet.agent.runtime.container_engine import ContainerEngine, EngineError, ImageInfo

logger = logging.getLogger("gpufleet.agent")


class ImageReporter:
    """The node's local images for heartbeats (DD9) and pre-pulls asked by the controller.

    The list is re-read from the engine at most every ``refresh_s`` seconds, and on the next
    call after :meth:`mark_dirty` (a container start or a pull). Pre-pulls run one at a time in
    a background thread; a failed pull is logged and retried only when asked again.
    """

    def __init__(self, engine: ContainerEngine, refresh_s: float = 30.0) -> None:
        self.engine = engine
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._images: list[ImageInfo] | None = None
        self._read_at = 0.0
        self._pulling: set[str] = set()

    def mark_dirty(self) -> None:
        self._read_at = 0.0

    def images(self) -> list[ImageInfo] | None:
        """The current list, or None when the engine could not be asked."""
        now = time.monotonic()
        with self._lock:
            if self._images is None or now - self._read_at >= self.refresh_s or not self._read_at:
                try:
                    self._images = self.engine.images()
                except (EngineError, ValueError) as exc:
                    logger.warning("cannot list local images: %s", exc)
                    return None
                self._read_at = now
            return list(self._images)

    def prepull(self, images: Iterable[str]) -> None:
        """Pull each image not already present or being pulled, in the background."""
        with self._lock:
            todo = [i for i in images if i and i not in self._pulling]
            self._pulling.update(todo)
        for image in todo:
            threading.Thread(
                target=self._pull, args=(image,), name="agent-prepull", daemon=True
            ).start()

    def _pull(self, image: str) -> None:
        try:
            if not self.engine.has_image(image):
                t0 = time.monotonic()
                self.engine.pull(image)
                logger.info("pre-pulled %s in %.1f s", image, time.monotonic() - t0)
        except EngineError as exc:
            logger.warning("pre-pull of %s failed: %s", image, exc)
        finally:
            with self._lock:
                self._pulling.discard(image)
            self.mark_dirty()
