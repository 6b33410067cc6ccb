"""High availability: coordinators on one PostgreSQL database, one of which leads."""
