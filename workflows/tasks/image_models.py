"""The image architectures moved to the image task's wing, workflows.tasks.image.models; their names
stay importable from here for the benches and reliability/, which import them by this path."""

from workflows.tasks.image.models import (  # noqa: F401
    ARCHITECTURES,
    _with_labels,
    build_image_classifier,
    image_config,
)
