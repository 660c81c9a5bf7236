#!/bin/sh
# Build a base image from Debian packages alone (debootstrap), for builds that cannot reach
# a container registry: air-gapped build machines, or a Debian mirror as the only source.
#
#   deploy/debian-base-image.sh python ctxcache-base/python:3.11-bookworm
#   deploy/debian-base-image.sh redis  ctxcache-base/redis:7-bookworm
#
# then build with them (docs/deploy.md, "Builds behind a mirror or offline"):
#
#   docker build -f deploy/Dockerfile --build-arg PYTHON_IMAGE=ctxcache-base/python:3.11-bookworm .
#   CTXCACHE_PYTHON_IMAGE=ctxcache-base/python:3.11-bookworm \
#   CTXCACHE_REDIS_IMAGE=ctxcache-base/redis:7-bookworm docker compose --profile cpu up --wait
#
# `python`: Debian bookworm's Python 3.11 (the version of python:3.11-slim-bookworm, and of
# the torch CPU wheels the Dockerfile pins) with venv and `python` on PATH, CA certificates.
# `redis`: Debian bookworm's redis-server (7.0) with WORKDIR /data, like redis:7.
# Needs root, debootstrap and docker. DEBIAN_MIRROR picks the mirror (default deb.debian.org).
set -eu

kind=${1:?usage: $0 python|redis IMAGE_NAME}
name=${2:?usage: $0 python|redis IMAGE_NAME}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=${DEBIAN_SUITE:-bookworm}

case "$kind" in
python)
    packages=ca-certificates,python3,python3-venv,python-is-python3
    set -- --change 'CMD ["python3"]'
    ;;
redis)
    packages=redis-server,redis-tools
    set -- --change 'WORKDIR /data' --change 'EXPOSE 6379' \
        --change 'ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]' --change 'CMD ["redis-server"]'
    ;;
*)
    echo "unknown kind: $kind (python or redis)" >&2
    exit 2
    ;;
esac

rootfs=$(mktemp -d "${TMPDIR:-/tmp}/debian-base.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror"

# What a container does not need: package lists, caches, docs, man pages, locales.
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/log/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/tmp/*
find "$rootfs"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' \
    -exec rm -rf {} + 2>/dev/null || true
# The image gets its resolver and hosts from Docker at run time.
: > "$rootfs"/etc/resolv.conf
echo "$suite" > "$rootfs"/etc/debian_chroot
if [ "$kind" = redis ]; then
    mkdir -p "$rootfs"/data
    # As redis:7's entrypoint: a server started without a config file turns protected mode
    # off, else it refuses every client from another container.
    cat > "$rootfs"/usr/local/bin/docker-entrypoint.sh <<'SCRIPT'
#!/bin/sh
set -e
case "$1" in -*) set -- redis-server "$@" ;; esac
if [ "$1" = redis-server ]; then
    case "$2" in
    *.conf) ;;
    *) shift; set -- redis-server "$@" --protected-mode no ;;
    esac
fi
exec "$@"
SCRIPT
    chmod 755 "$rootfs"/usr/local/bin/docker-entrypoint.sh
fi

# "$@": the --change arguments set above
tar -C "$rootfs" --numeric-owner -c . | docker import "$@" - "$name"
docker image inspect --format '{{.Id}} {{.Size}}' "$name"
