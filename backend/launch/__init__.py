"""Starting the servers: tritonserver with Tritium as its `tritium` backend (`tritonserver`)."""
