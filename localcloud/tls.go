package localcloud

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/runs"
)

// loadOrCreateCert returns the server's certificate, generating a
// self-signed one (SAN 127.0.0.1, ::1, localhost) at first start or when
// the stored one expires within a week.
func loadOrCreateCert(dir string, now time.Time) (tls.Certificate, *x509.CertPool, error) {
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("create %s: %w", dir, err)
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	switch {
	case err == nil:
		leaf := cert.Leaf
		if leaf != nil && now.Add(7*24*time.Hour).Before(leaf.NotAfter) {
			pool := x509.NewCertPool()
			pool.AddCert(leaf)
			return cert, pool, nil
		}
	case errors.Is(err, fs.ErrNotExist):
	default:
		return tls.Certificate{}, nil, fmt.Errorf("load the TLS certificate %s: %w (delete %s and %s to generate a new one)", certFile, err, certFile, keyFile)
	}

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("generate the TLS key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("generate the TLS serial: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "sandboxd-localcloud", Organization: []string{"sandboxd"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(10, 0, 0),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true, // self-signed: it is its own root in SSL_CERT_FILE
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		DNSNames:              []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("create the TLS certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("encode the TLS key: %w", err)
	}
	if err := runs.WriteFileAtomic(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("write the TLS key: %w", err)
	}
	if err := runs.WriteFileAtomic(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("write the TLS certificate: %w", err)
	}
	cert, err = tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("load the new TLS certificate: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert.Leaf)
	return cert, pool, nil
}

// loadOrCreateToken returns the access token kept in path (0600),
// generating it at first start.
func loadOrCreateToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		t := strings.TrimSpace(string(b))
		if t == "" {
			return "", fmt.Errorf("the access token file %s is empty: delete it to generate a new token", path)
		}
		return t, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("read the access token %s: %w", path, err)
	}
	raw := make([]byte, 32)
	if _, err := rand.Read(raw); err != nil {
		return "", fmt.Errorf("generate the access token: %w", err)
	}
	t := "lca_" + hex.EncodeToString(raw)
	if err := runs.WriteFileAtomic(path, []byte(t+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("write the access token %s: %w", path, err)
	}
	return t, nil
}
