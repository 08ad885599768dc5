# bench/need.sh — sourced by the bench scripts: `need TOOL [PACKAGE]` installs PACKAGE
# (default: TOOL) from Debian's packages when TOOL is missing and this runs as root; else it
# says what to install and exits.
need() {
    local tool=$1 pkg=${2:-$1}
    command -v "$tool" >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ]; then
        echo "== installing $pkg" >&2
        apt-get update -qq >/dev/null 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$pkg" >/dev/null
    else
        echo "$tool is missing (apt-get install $pkg)" >&2
        exit 1
    fi
}
