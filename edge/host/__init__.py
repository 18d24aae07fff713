"""edge on its host: the systemd units it installs and the doctor that checks them."""
