package celeryproto

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"github.com/onceler/onceler/internal/clip"
)

// Content types of the serializers Celery uses.
const (
	ContentTypeJSON    = "application/json"
	ContentTypeMsgpack = "application/x-msgpack"
	ContentTypeYAML    = "application/x-yaml"
	ContentTypePickle  = "application/x-python-serialize"
)

// serializerFor maps a content type (with kombu's aliases) to a serializer name.
func serializerFor(contentType string) (string, error) {
	ct := strings.ToLower(strings.TrimSpace(contentType))
	if i := strings.IndexByte(ct, ';'); i >= 0 {
		ct = strings.TrimSpace(ct[:i])
	}
	switch ct {
	case ContentTypeJSON, "json", "application/data", "text/json":
		return "json", nil
	case ContentTypeMsgpack, "msgpack", "application/msgpack":
		return "msgpack", nil
	case ContentTypeYAML, "yaml", "application/yaml", "text/yaml":
		return "yaml", nil
	case ContentTypePickle, "pickle", "application/python-pickle":
		return "", decodeErr(ErrPickle, nil, "unsupported content type %q: pickle is never decoded", contentType)
	default:
		return "", decodeErr(ErrUnsupportedContentType, nil, "unsupported content type %q", clip.String(contentType, 100))
	}
}

// maxYAMLBody bounds a YAML body after decompression. The YAML parser takes
// about a hundred times a body's size in memory and seconds of CPU for a
// few MiB (a 16 MiB body, inflated from 16 kB, took 1.8 GiB and 9 s), so
// YAML bodies get a tighter bound than the others; Celery messages are far
// smaller.
const maxYAMLBody = 1 << 20

func (dec *Decoder) unmarshal(serializer string, data []byte, mt *meter) (any, error) {
	switch serializer {
	case "json":
		return decodeJSON(&dec.scratch, data, mt)
	case "msgpack":
		return decodeMsgpack(data, mt)
	case "yaml":
		doc, err := yamlDocument(data)
		if err != nil {
			return nil, err
		}
		if err := safeYAML(doc, 0); err != nil {
			return nil, err
		}
		var v any
		if err := doc.Decode(&v); err != nil {
			return nil, err
		}
		return normalize(v, 0)
	}
	return nil, fmt.Errorf("unknown serializer %q", serializer)
}

// yamlDocument parses the single YAML document of data (none reads as
// null). A stream of more than one document is refused, as PyYAML's
// safe_load refuses it ("expected a single document in the stream"):
// taking the first and ignoring the rest would run a message Celery's
// worker cannot read.
func yamlDocument(data []byte) (*yaml.Node, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	var next yaml.Node
	switch err := dec.Decode(&next); {
	case errors.Is(err, io.EOF):
		return &doc, nil
	case err != nil:
		return nil, err
	}
	return nil, errors.New("yaml stream holds more than one document (expected a single document)")
}

// normalize converts msgpack and YAML values to the package's value types:
// integers of any width to int64 (float64 past its range), float32 to
// float64, maps to map[string]any.
func normalize(v any, depth int) (any, error) {
	if depth > maxDepth {
		return nil, fmt.Errorf("nesting deeper than %d", maxDepth)
	}
	switch x := v.(type) {
	case nil, bool, string, int64, float64, []byte, time.Time:
		return x, nil
	case int:
		return int64(x), nil
	case int8:
		return int64(x), nil
	case int16:
		return int64(x), nil
	case int32:
		return int64(x), nil
	case uint:
		return uintValue(uint64(x)), nil
	case uint8:
		return int64(x), nil
	case uint16:
		return int64(x), nil
	case uint32:
		return int64(x), nil
	case uint64:
		return uintValue(x), nil
	case float32:
		return float64(x), nil
	case []any:
		for i, e := range x {
			n, err := normalize(e, depth+1)
			if err != nil {
				return nil, err
			}
			x[i] = n
		}
		return x, nil
	case map[string]any:
		for k, e := range x {
			n, err := normalize(e, depth+1)
			if err != nil {
				return nil, err
			}
			x[k] = n
		}
		return x, nil
	case map[any]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			n, err := normalize(e, depth+1)
			if err != nil {
				return nil, err
			}
			out[keyString(k)] = n
		}
		return out, nil
	default:
		return nil, fmt.Errorf("unsupported value of type %T", v)
	}
}

func uintValue(u uint64) any {
	if u > math.MaxInt64 {
		return float64(u)
	}
	return int64(u)
}

func keyString(k any) string {
	switch x := k.(type) {
	case string:
		return x
	case []byte:
		return string(x)
	case nil:
		return "None"
	case bool:
		if x {
			return "True"
		}
		return "False"
	default:
		return fmt.Sprint(x)
	}
}

// safeYAMLTags are the tags PyYAML's safe_load constructs; any other tag
// (!!python/object and friends, local tags) is refused as safe_load does.
var safeYAMLTags = map[string]bool{
	"!!str": true, "!!int": true, "!!float": true, "!!bool": true, "!!null": true,
	"!!map": true, "!!seq": true, "!!timestamp": true, "!!binary": true, "!!merge": true, "": true,
}

func safeYAML(n *yaml.Node, depth int) error {
	if depth > 10000 {
		return fmt.Errorf("yaml nested deeper than 10000")
	}
	if !safeYAMLTags[n.ShortTag()] && n.Kind != yaml.DocumentNode && n.Kind != yaml.AliasNode {
		return fmt.Errorf("yaml tag %q is not allowed (safe load only)", clip.String(n.Tag, 64))
	}
	for _, c := range n.Content {
		if err := safeYAML(c, depth+1); err != nil {
			return err
		}
	}
	return nil
}
