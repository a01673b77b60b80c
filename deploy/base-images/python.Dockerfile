# A stand-in for python:3.12-slim (see build.sh): Debian's Python in a venv whose `python` and
# `pip` come first on the PATH, as the official image's do. pip reaches PyPI (or PIP_INDEX_URL)
# when deploy/Dockerfile installs the package.
FROM local/debian-rootfs:bookworm
LABEL org.opencontainers.image.description="stand-in for python:3.12-slim: Debian's python3 in /usr/local/python"
# The certificate authorities build.sh was given (none, unless the machine adds its own).
COPY ca-certificates/ /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null && python3 -m venv /usr/local/python
ENV PATH=/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8
CMD ["python"]
