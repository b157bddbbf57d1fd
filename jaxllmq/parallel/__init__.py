"""Device meshes and the tables that map logical axes onto them."""
